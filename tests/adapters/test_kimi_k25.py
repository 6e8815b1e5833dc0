"""Kimi-K2.5: the resize geometry and token counts against vLLM's rules for many sizes, the
restated reference against vLLM 0.33's own processor (digests it produced), the transform
against the reference on both normalise paths, prompt expansion, routing plans, a folder's
``media_proc_cfg``, and the render server's wire names and request-counter ids.

The registry-driven harness (``tests/support/adapter_parity.py``) covers random images against
the restated reference (``tests/support/kimi_reference.py``).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from kimi_reference import reference_outputs, reference_resize
from parity import SEED

from aiomm.adapters import build_processor, from_pretrained
from aiomm.adapters.kimi_k25 import (
    KIMI_K25_MEDIA_PROC_CFG,
    KimiK25MultiModalProcessor,
    KimiParams,
    build_hf_processor,
    navit_size,
)
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig
from aiomm.vllm.generate_request import WireForm, counter_ids, rename_modalities

#: (height, width) of the images vLLM's processor digested, drawn by ``photo_like`` from
#: ``np.random.default_rng(20261206)`` in this order
DIGESTED_SIZES = [(57, 33), (480, 640), (2000, 2400), (7200, 100), (1080, 1920), (1, 1)]
#: ``KimiK25FusedVisionProcessor(media_proc_cfg).preprocess`` of those images in vLLM 0.33
#: (``vllm/transformers_utils/processors/kimi_k25_vision_fused.py``, numba kernel), with
#: ``do_normalize`` off (uint8) and on (float32): sha256 of ``pixel_values``' bytes
VLLM_DIGESTS = {
    "uint8": (
        [33300, 3, 14, 14],
        "3f3c04f8e9032bef54271c68718a595d9e30d48e8b6f49d1e24fb97319d05257",
    ),
    "float32": (
        [33300, 3, 14, 14],
        "383d993a6d49cbeda9307f1b2da1eb39541b254ea7b059c61d1cd76146dcaf08",
    ),
}
VLLM_GRIDS = [[1, 6, 4], [1, 36, 46], [1, 118, 142], [1, 512, 8], [1, 78, 138], [1, 2, 2]]
VLLM_TOKENS = [6, 414, 4189, 1024, 2691, 1]


def _processor(device_normalize: bool = True) -> KimiK25MultiModalProcessor:
    config = MultiModalConfig(mm_device_do_normalize=device_normalize)
    proc = build_processor("kimi-k2.5", config=config, backend="pil")
    assert isinstance(proc, KimiK25MultiModalProcessor)
    return proc


def _digested_images() -> list[PIL.Image.Image]:
    rng = np.random.default_rng(20261206)
    return [photo_like(rng, h, w) for h, w in DIGESTED_SIZES]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _prompt(proc: KimiK25MultiModalProcessor, n: int) -> list[int]:
    tok = proc.hf_processor.tokenizer
    text = "user " + " ".join(["<|media_pad|> hi"] * n) + " assistant"
    return list(tok(text)["input_ids"])


def test_geometry_and_tokens_equal_vllms_for_many_sizes() -> None:
    rng = random.Random(SEED)
    fixed = [(1, 1), (13, 13), (14, 14), (27, 29), (28, 28), (1792, 1792), (1793, 1792),
             (1806, 1806), (7168, 1), (1, 7168), (7169, 14), (20000, 20), (20, 20000),
             (2400, 2000), (100000, 3)]  # fmt: skip
    sizes = fixed + [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(3000)]
    params = KimiParams()
    for width, height in sizes:
        ref = reference_resize(width, height)
        new_h, new_w, padded_h, padded_w = navit_size(height, width, params)
        assert (new_w, new_h) == (ref["new_width"], ref["new_height"]), (width, height)
        assert (padded_w - new_w, padded_h - new_h) == (ref["pad_width"], ref["pad_height"])
        assert padded_h % 28 == 0 and padded_w % 28 == 0
        assert (padded_h // 28) * (padded_w // 28) == ref["num_tokens"], (width, height)
        assert (padded_h // 14) * (padded_w // 14) <= 16384 + 4 * (padded_h + padded_w) // 14


def test_the_reference_equals_vllms_processor() -> None:
    ref = reference_outputs(_digested_images())
    for key, name in (("uint8", "uint8"), ("float", "float32")):
        shape, digest = VLLM_DIGESTS[name]
        assert list(ref[key].shape) == shape and _sha(ref[key]) == digest, name
    assert ref["grid_thws"].tolist() == VLLM_GRIDS
    assert ref["tokens"] == VLLM_TOKENS


@pytest.mark.parametrize("device_normalize", [True, False])
def test_transform_equals_vllms_processor(device_normalize: bool) -> None:
    proc = _processor(device_normalize)
    images = _digested_images()
    out = proc.apply(_prompt(proc, len(images)), {"image": images})
    merged = out.merged_kwargs()
    shape, digest = VLLM_DIGESTS["uint8" if device_normalize else "float32"]
    assert list(merged["pixel_values"].shape) == shape
    assert _sha(merged["pixel_values"]) == digest
    assert merged["grid_thws"].tolist() == VLLM_GRIDS
    assert [r.length for r in out.mm_placeholders["image"]] == VLLM_TOKENS
    assert (out.normalization is not None) == device_normalize


def test_prompt_expansion_and_ranges() -> None:
    proc = _processor()
    pad = proc.media_token_id
    images = [photo_like(np.random.default_rng(1), h, w) for h, w in ((60, 90), (300, 20))]
    prompt = _prompt(proc, 2)
    out = proc.apply(prompt, {"image": images})
    counts = [reference_resize(im.width, im.height)["num_tokens"] for im in images]
    expected: list[int] = []
    it = iter(counts)
    for t in prompt:
        expected.extend([t] * next(it) if t == pad else [t])
    assert out.prompt_token_ids == expected
    for r, n in zip(out.mm_placeholders["image"], counts, strict=True):
        assert r.length == n and r.is_embed is None
        assert set(expected[r.offset : r.offset + r.length]) == {pad}


def test_plans_equal_processed_items() -> None:
    proc = _processor()
    rng = np.random.default_rng(2)
    for h, w in ((1, 1), (57, 33), (300, 4000), (1800, 1800)):
        image = photo_like(rng, h, w)
        item = proc.process_items({"image": [image]}, {})["image"][0]
        plan = proc.plan_image(h, w, {})
        assert torch.equal(plan.data["grid_thws"], item.data["grid_thws"]), (h, w)


def test_rgba_drops_alpha_as_vllm_converts() -> None:
    """vLLM's processor converts a non-RGB PIL image with ``convert("RGB")`` (no compositing)."""
    rng = np.random.default_rng(3)
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (40, 50, 4), dtype=np.uint8), "RGBA")
    proc = _processor()
    ours = proc.process_items({"image": [rgba]}, {})["image"][0].data["pixel_values"]
    assert torch.equal(ours, reference_outputs([rgba.convert("RGB")])["uint8"])


def test_no_hf_transform_and_no_kwargs() -> None:
    with pytest.raises(ValueError, match="native"):
        build_processor("kimi-k2.5", config=MultiModalConfig(transform="hf"))
    assert _processor().allowed_hf_kwargs() == frozenset()


def test_folder_media_proc_cfg_is_read(tmp_path: Path) -> None:
    """A folder's processor takes ``media_proc_cfg`` from ``preprocessor_config.json``, where
    vLLM's processor reads it (the folders ``write_model_folder`` writes keep it there)."""
    build_hf_processor().save_pretrained(str(tmp_path))
    (tmp_path / "processor_config.json").unlink(missing_ok=True)
    cfg = {**KIMI_K25_MEDIA_PROC_CFG, "in_patch_limit": 1024}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": cfg}))
    proc = from_pretrained(tmp_path, architecture="KimiK25ForConditionalGeneration")
    assert isinstance(proc, KimiK25MultiModalProcessor)
    assert proc.params.max_patches == 1024
    # 2000 px scaled by sqrt(1024 / 142**2) is 450 px, padded to 476: 34 patches a side
    assert proc.plan_image(2000, 2000, {}).data["grid_thws"].tolist() == [1, 34, 34]


def test_wire_names_and_counter_ids() -> None:
    proc = _processor()
    wire = WireForm.of(proc)
    assert wire.modality_names == {"image": "vision_chunk"}
    features: dict[str, Any] = {
        "mm_hashes": {"image": ["a"]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
        "kwargs_data": None,
        "mm_metadata": None,
    }
    rename_modalities(features, wire.modality_names)
    assert features["mm_hashes"] == {"vision_chunk": ["a"]}
    assert features["mm_placeholders"] == {"vision_chunk": [{"offset": 1, "length": 2}]}
    assert features["kwargs_data"] is None
    ids = counter_ids(
        7, {"image": ["h0", "h1", "h2"]}, {"image": [None, "mine", None]}, wire.modality_names
    )
    assert ids == {
        "image": ["renderer0-mm-7-vision_chunk-0", "mine", "renderer0-mm-7-vision_chunk-2"]
    }
