"""The Qwen-VL transform of one image calls torch only for the resize passes and zero-copy
conversions: views and bookkeeping are numpy's, because every torch call releases the GIL and a
transform thread that gives it up waits to get it back (under the render server's load, often
behind the event loop). A torch view op added back to this path fails here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_calls import NO_GIL_RELEASE, torch_calls

from aiomm.adapters import build_processor
from aiomm.errors import ProcessingError
from aiomm.processing.fields import Repeat


def decoded(height: int, width: int, seed: int) -> np.ndarray:
    """RGB pixels as the decoder returns them: the first three channels of 4-byte pixels."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, 4), dtype=np.uint8)[:, :, :3]


@pytest.mark.parametrize("writable", [True, False])
@pytest.mark.parametrize(("height", "width"), [(480, 640), (777, 333), (28, 28)])
def test_qwen_vl_transform_calls_torch_only_to_resize(
    height: int, width: int, writable: bool
) -> None:
    processor = build_processor("qwen2-vl")
    processor.process_items({"image": [decoded(50, 60, 0)]}, {})  # builds its tables once
    pixels = decoded(height, width, 1)
    pixels.base.flags.writeable = writable  # Pillow's own pixel bytes are read-only
    items, calls = torch_calls(lambda: processor.process_items({"image": [pixels]}, {}))
    item = items["image"][0]
    assert item.data["pixel_values"].dtype == torch.uint8
    releasing = {name: n for name, n in calls.items() if name not in NO_GIL_RELEASE}
    resized = releasing.pop("_upsample_bicubic2d_aa", 0)
    assert releasing == {}, f"torch calls that release the GIL: {releasing}"
    assert resized <= 2  # the horizontal and the vertical pass


def test_the_numpy_repeat_is_the_torch_repeat() -> None:
    rows = torch.arange(5 * 12, dtype=torch.int16).reshape(5, 12)
    repeat = Repeat(blocks=3, times=2)
    expected = repeat.expand(rows).reshape(5, -1)
    got = repeat.expand_array(rows.numpy())
    assert got.shape == (5, 3, 2, 4)
    assert np.array_equal(got.reshape(5, -1), expected.numpy())
    with pytest.raises(ProcessingError, match="do not split into 3 equal blocks"):
        repeat.expand_array(np.zeros((5, 13), np.uint8))
    with pytest.raises(ProcessingError, match="do not split into 3 equal blocks"):
        repeat.expand_array(np.zeros(12, np.uint8))
    with pytest.raises(ProcessingError, match="do not split into 0 equal blocks"):
        Repeat(blocks=0, times=2).expand_array(np.zeros((5, 12), np.uint8))
    with pytest.raises(ProcessingError):
        Repeat(blocks=3, times=0).expand_array(np.zeros((5, 12), np.uint8))
