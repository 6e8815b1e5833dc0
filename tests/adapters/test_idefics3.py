"""Idefics3 cases beyond the parity harness: the resize and the sub-image grid against
transformers' own functions over many sizes, the prompt expansion against the processor's,
processor kwargs (no splitting, another sub-image size), the wire form and the errors."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.adapters.idefics3 import grid, resized_size
from aiomm.errors import ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig
from aiomm.vllm.generate_request import WireForm

NAME = "idefics3"
SIDE = 364


def _sizes(rng: random.Random) -> list[tuple[int, int]]:
    edges = [1, 2, 3, 181, 182, 363, 364, 365, 727, 728, 729, 1092, 1456, 1457, 4096, 5000]
    sizes = [(h, w) for h in edges for w in edges]
    sizes += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(600)]
    sizes += [(rng.randint(1, 60), rng.randint(1, 8000)) for _ in range(100)]
    return sizes


@pytest.mark.parametrize("longest_edge", [1456, 1000, 364, 5000])
def test_the_resize_size_is_transformers(longest_edge: int) -> None:
    from transformers.models.idefics3 import image_processing_idefics3 as hf

    for height, width in _sizes(random.Random(f"{SEED}-{longest_edge}")):
        image = torch.empty(0, height, width)
        want = hf.get_resize_output_image_size(image, resolution_max_side=longest_edge)
        assert resized_size(height, width, longest_edge) == want, (height, width)


def test_the_grid_is_the_one_vllm_counts() -> None:
    """vLLM counts each image's sub-images with ``get_number_of_image_patches``; the adapter's
    grid and count equal it for every size."""
    proc = build_processor(NAME)
    ip = proc.image_processor
    params = proc._resolve_params({})
    for height, width in _sizes(random.Random(SEED)):
        patches, rows, cols = ip.get_number_of_image_patches(height, width, {})
        assert proc.image_grid(height, width, params) == (rows, cols), (height, width)
        assert proc.num_patches(height, width, params) == max(patches, 1), (height, width)


def test_the_grid_is_the_transforms() -> None:
    """With the checkpoint's parameters the first resize makes the long side 1456 (a multiple
    of 364), so the split the transform makes is the grid vLLM counts."""
    proc = build_processor(NAME)
    params = proc._resolve_params({})
    for height, width in _sizes(random.Random(f"{SEED}-split")):
        split = grid(*proc.encoder_size(height, width, params), SIDE)
        assert split == proc.image_grid(height, width, params), (height, width)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_the_rows_and_cols_are_the_image_processors(backend: str) -> None:
    ip = hf_processor(NAME, backend).image_processor
    proc = build_processor(NAME, backend=backend)
    params = proc._resolve_params({})
    rng = np.random.default_rng(SEED)
    sizes = [(1, 1), (364, 364), (365, 20), (20, 2000), (1456, 1456), (333, 500), (1080, 1920)]
    images = [photo_like(rng, h, w) for h, w in sizes]
    out = ip(images, return_row_col_info=True, do_rescale=False, do_normalize=False)
    want = list(zip(out["rows"][0], out["cols"][0], strict=True))
    assert [proc.image_grid(h, w, params) for h, w in sizes] == want


@pytest.mark.parametrize(("rows", "cols"), [(0, 0), (1, 2), (4, 4), (3, 1)])
def test_the_image_text_is_the_processors(rows: int, cols: int) -> None:
    ref = hf_processor(NAME)
    proc = build_processor(NAME, ref)
    want = ref.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
    assert proc.image_text(rows, cols) == want
    details = proc.image_tokens(rows, cols)
    assert list(details.full) == ref.tokenizer.encode(want, add_special_tokens=False)
    assert details.is_embed == tuple(t == ref.image_token_id for t in details.full)
    assert sum(details.is_embed) == (rows * cols + 1) * 169


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_image_splitting": False},
        {"max_image_size": {"longest_edge": 182}, "size": {"longest_edge": 728}},
        {"resample": 2},
    ],
)
def test_processor_kwargs_match_the_processor(backend: str, kwargs: dict[str, Any]) -> None:
    sizes = [(100, 150), (600, 250)]
    check_case(NAME, backend, len(sizes), SEED, sizes=sizes, kwargs=kwargs, classic=True)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_classic_path_equals_the_processor(backend: str) -> None:
    check_case(NAME, backend, 3, SEED + 1, sizes=[(1, 1), (364, 1500), (900, 700)], classic=True)


def test_items_hold_a_bool_mask_sent_as_int64() -> None:
    proc = build_processor(NAME, config=MultiModalConfig(mm_device_do_normalize=True))
    images = [photo_like(np.random.default_rng(0), 40, 90)]
    ids = proc.hf_processor.tokenizer("user <image> assistant")["input_ids"]
    out = proc.apply(ids, {"image": images})
    (item,) = out.mm_kwargs["image"]
    assert list(item.data) == ["pixel_values", "num_patches", "pixel_attention_mask"]
    assert item.data["pixel_attention_mask"].dtype == torch.bool
    assert bool(item.data["pixel_attention_mask"].all())
    assert item.prompt_data["grid"] == [2, 4]
    assert WireForm.of(proc).dtypes == {"pixel_attention_mask": torch.int64}


def test_the_plan_carries_the_grid() -> None:
    proc = build_processor(NAME)
    plan = proc.plan_image(40, 90, {})
    assert plan.prompt_data["grid"] == [2, 4]
    assert int(plan.data["num_patches"]) == 9


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": {"height": 364, "width": 364}},
        {"max_image_size": {"longest_edge": 0}},
        # the grid vLLM counts would not be the transform's
        {"size": {"longest_edge": 1000}},
        {"size": {"longest_edge": 4368}},
        {"do_resize": False},
        {"do_pad": False},
    ],
)
def test_bad_kwargs_are_refused(kwargs: dict[str, Any]) -> None:
    proc = build_processor(NAME)
    images = [photo_like(np.random.default_rng(0), 40, 90)]
    ids = proc.hf_processor.tokenizer("user <image> assistant")["input_ids"]
    with pytest.raises(ProcessorKwargsError):
        proc.apply(ids, {"image": images}, kwargs)
