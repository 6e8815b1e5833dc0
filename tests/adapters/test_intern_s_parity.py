"""Parity of the Intern-S adapters (Intern-S1-Pro, Intern-S2-Mobius) with their reference.

vLLM registers both architectures with ``Qwen3VLMultiModalProcessor``, i.e. over the checkpoint's
Qwen3-VL HF processor; transformers has that processor (``Qwen3VLProcessor`` with
``Qwen2VLImageProcessor`` or ``Qwen2VLImageProcessorPil``), so it is the reference, called here
directly. Every run draws fresh random images (the seed is printed on failure), 1 to 4 per prompt.
For both backends and both of our transforms: token ids equal the reference's ``input_ids``,
placeholder ranges cover exactly the image tokens, grids are equal, uint8 ``pixel_values`` equal
the reference's output with rescale/normalise off bit for bit, and normalised on the device they
equal its float output to a norm-wise relative error under 1e-6.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import parity
import pytest
import torch
from parity import SEED, hf_processor, rel_err

from aiomm.adapters import build_processor, get_adapter_info, supported_adapters
from aiomm.errors import UnknownArchitectureError
from aiomm.processing.processor import MultiModalConfig
from aiomm.samples import photo_like

NAMES = ("intern-s1-pro", "intern-s2-mobius")
ARCHITECTURES = {
    "intern-s1-pro": "InternS1ProForConditionalGeneration",
    "intern-s2-mobius": "InternS2MobiusForConditionalGeneration",
}
BACKENDS = ("torchvision", "pil")
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


SIZES = [(1, 1), (3, 5), (32, 32), (57, 33), (1, 150), (150, 1), (199, 3), (240, 320),
         (333, 500), (480, 640), (700, 20), (90, 610)]  # fmt: skip
SIZES_LARGE = [(1080, 1920), (1536, 2048)]


def draw_sizes(rng: random.Random, count: int, *, large: bool) -> list[tuple[int, int]]:
    # Qwen-VL's smart_resize rejects aspect ratios above 200
    return parity.draw_sizes(rng, count, SIZES + (SIZES_LARGE if large else []), max_aspect=200)


def prompt_text(n_images: int) -> str:
    start, end = "<|im_start|>user", "<|im_end|> <|im_start|>assistant"
    return parity.prompt_text(n_images, PLACEHOLDER, start=start, end=end)


def reference(proc: Any, text: str, images: list[Any], uint8: bool) -> Any:
    kwargs = {"do_rescale": False, "do_normalize": False} if uint8 else {}
    return proc(text=[text], images=images, return_tensors="pt", **kwargs)


def check_case(name: str, backend: str, n_images: int, case_seed: int, *, large: bool) -> None:
    rng = random.Random(case_seed)
    nrng = np.random.default_rng(case_seed)
    sizes = draw_sizes(rng, n_images, large=large)
    images = [photo_like(nrng, h, w) for h, w in sizes]
    ctx = f"[{name}/{backend} seed={case_seed} sizes={sizes}]"

    proc = hf_processor(name, backend)
    text = prompt_text(n_images)
    ref_u8 = reference(proc, text, images, uint8=True)
    ref_f = reference(proc, text, images, uint8=False)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    image_token = proc.image_token_id
    assert image_token == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    expected_ids = ref_u8["input_ids"][0].tolist()
    merge = proc.image_processor.merge_size

    outputs = {}
    for mode in ("hf", "native"):
        out = build_processor(name, proc, config=MultiModalConfig(transform=mode)).apply(
            prompt_ids, {"image": images}
        )
        merged = out.merged_kwargs()
        assert out.prompt_token_ids == expected_ids, f"{ctx} {mode}: token ids differ"
        assert torch.equal(merged["image_grid_thw"], ref_u8["image_grid_thw"]), f"{ctx} grid"

        ranges = out.mm_placeholders["image"]
        assert len(ranges) == n_images, ctx
        covered = sorted(i for r in ranges for i in range(r.offset, r.offset + r.length))
        assert covered == [i for i, t in enumerate(expected_ids) if t == image_token], ctx
        for r, grid in zip(ranges, ref_u8["image_grid_thw"], strict=True):
            assert r.length == r.embed_count == int(grid.prod()) // merge**2, ctx

        pv = merged["pixel_values"]
        ref_pv = ref_u8["pixel_values"]
        assert pv.dtype == torch.uint8 and pv.shape == ref_pv.shape, f"{ctx} {mode}: {pv.shape}"
        assert torch.equal(pv.double(), ref_pv.double()), f"{ctx} {mode}: uint8 pixels differ"

        norm = out.normalization
        assert norm is not None and norm.layout.name == "PATCHES", ctx
        normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
        err = rel_err(normalised, ref_f["pixel_values"])
        assert err < 1e-6, f"{ctx} {mode}: normalised rel err {err:.3g}"
        outputs[mode] = pv
    assert torch.equal(outputs["hf"], outputs["native"]), f"{ctx}: native != hf"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_parity_random_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-{name}-{backend}")
    for n_images in (1, 2, 3, 4):
        check_case(name, backend, n_images, rng.randrange(2**31), large=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_large_images(backend: str) -> None:
    rng = random.Random(f"{SEED}-large-{backend}")
    check_case("intern-s1-pro", backend, 2, rng.randrange(2**31), large=True)


def test_reference_is_qwen3_vl_with_the_checkpoint_geometry() -> None:
    """The checkpoints' vision towers: patch 16, temporal patch 2, 2x2 merge (factor 32)."""
    for name in NAMES:
        ip = hf_processor(name, "torchvision").image_processor
        assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (16, 2, 2), name
        assert type(hf_processor(name, "pil")).__name__ == "Qwen3VLProcessor"


def test_registry_lists_both_with_device_normalize_default() -> None:
    listed = {info.short_name: info for info in supported_adapters()}
    for name in NAMES:
        info = listed[name]
        assert info.architecture == ARCHITECTURES[name]
        assert get_adapter_info(info.architecture) is info
        assert info.mm_device_do_normalize is True
        assert build_processor(name, hf_processor(name, "pil")).device_normalize is True
    with pytest.raises(UnknownArchitectureError):
        get_adapter_info("InternS1ForConditionalGeneration")
