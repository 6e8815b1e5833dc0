"""Parity of the Qwen-VL family adapters with the HF processors they reproduce.

Every run draws fresh random images (the seed is printed on failure): tiny, large, extreme-but-
legal aspect ratios, 1 to 4 images per prompt. For both HF backends (torchvision and PIL) and both
of our transforms (``hf`` and ``native``): token ids equal HF's ``input_ids``, placeholder ranges
cover exactly the image tokens, grids are equal, uint8 ``pixel_values`` equal HF's output with
rescale/normalise disabled bit for bit, and after ``FusedMMInputNorm`` they equal HF's default
float output to a norm-wise relative error under 1e-6.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import parity
import pytest
import torch
from parity import SEED, hf_processor, rel_err

from aiomm.adapters import build_processor
from aiomm.processing.processor import MultiModalConfig
from aiomm.samples import photo_like

QWEN_FAMILY = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5", "qwen3.5-moe",
               "qwen4-exp")  # fmt: skip
BACKENDS = ("torchvision", "pil")
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


SIZES_SMALL = [(1, 1), (3, 5), (28, 28), (57, 33), (1, 150), (150, 1), (199, 3), (240, 320),
               (333, 500), (480, 640), (700, 20)]  # fmt: skip
SIZES_LARGE = [(1080, 1920), (1536, 2048)]


def draw_sizes(rng: random.Random, count: int, *, large: bool) -> list[tuple[int, int]]:
    pool = SIZES_SMALL + (SIZES_LARGE if large else [])
    return parity.draw_sizes(rng, count, pool, max_aspect=200)


def prompt_text(n_images: int) -> str:
    start, end = "<|im_start|>user", "<|im_end|> <|im_start|>assistant"
    return parity.prompt_text(n_images, PLACEHOLDER, start=start, end=end)


def hf_reference(proc: Any, text: str, images: list[Any], uint8: bool) -> dict[str, Any]:
    kwargs = {"do_rescale": False, "do_normalize": False} if uint8 else {}
    return proc(text=[text], images=images, return_tensors="pt", **kwargs)


def check_case(
    name: str,
    backend: str,
    n_images: int,
    case_seed: int,
    *,
    large: bool,
    sizes: list[tuple[int, int]] | None = None,
) -> None:
    rng = random.Random(case_seed)
    nrng = np.random.default_rng(case_seed)
    sizes = sizes or draw_sizes(rng, n_images, large=large)
    images = [photo_like(nrng, h, w) for h, w in sizes]
    ctx = f"[{name}/{backend} seed={case_seed} sizes={sizes}]"

    proc = hf_processor(name, backend)
    text = prompt_text(n_images)
    ref_u8 = hf_reference(proc, text, images, uint8=True)
    ref_f = hf_reference(proc, text, images, uint8=False)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    image_token = proc.image_token_id

    outputs = {}
    for mode in ("hf", "native"):
        ours = build_processor(name, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"image": images})
        merged = out.merged_kwargs()
        expected_ids = ref_u8["input_ids"][0].tolist()
        assert out.prompt_token_ids == expected_ids, f"{ctx} {mode}: token ids differ"
        assert torch.equal(merged["image_grid_thw"], ref_u8["image_grid_thw"]), f"{ctx} grid"

        ranges = out.mm_placeholders["image"]
        assert len(ranges) == n_images, ctx
        covered = sorted(i for r in ranges for i in range(r.offset, r.offset + r.length))
        expected_pos = [i for i, t in enumerate(expected_ids) if t == image_token]
        assert covered == expected_pos, f"{ctx} {mode}: placeholder ranges"
        merge = proc.image_processor.merge_size
        for r, grid in zip(ranges, ref_u8["image_grid_thw"], strict=True):
            assert r.length == int(grid.prod()) // merge**2, ctx

        pv = merged["pixel_values"]
        assert pv.dtype == torch.uint8, f"{ctx} {mode}: {pv.dtype}"
        ref_pv = ref_u8["pixel_values"]
        assert pv.shape == ref_pv.shape, f"{ctx} {mode}: {pv.shape} vs {ref_pv.shape}"
        assert torch.equal(pv, ref_pv.to(torch.uint8)) and torch.equal(
            pv.double(), ref_pv.double()
        ), f"{ctx} {mode}: uint8 pixel_values differ from HF's"

        norm = out.normalization
        assert norm is not None and norm.layout.name == "PATCHES"
        normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
        err = rel_err(normalised, ref_f["pixel_values"])
        assert err < 1e-6, f"{ctx} {mode}: normalised rel err {err:.3g}"
        outputs[mode] = pv
    assert torch.equal(outputs["hf"], outputs["native"]), f"{ctx}: native != hf"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", QWEN_FAMILY)
def test_parity_small_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-{name}-{backend}")
    for n_images in (1, 2, 3, 4):
        check_case(name, backend, n_images, rng.randrange(2**31), large=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen2-vl", "qwen3-vl"])
def test_parity_large_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-large-{name}-{backend}")
    check_case(name, backend, 2, rng.randrange(2**31), large=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_huge_photo(backend: str) -> None:
    """A 12-megapixel photo: kept near full size by Qwen3-VL's 16 Mpx bound."""
    seed = random.Random(f"{SEED}-huge-{backend}").randrange(2**31)
    check_case("qwen3-vl", backend, 1, seed, large=True, sizes=[(3024, 4032)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_classic_cpu_path_native_equals_hf_float(backend: str) -> None:
    """With mm_device_do_normalize off, both transforms return HF's float output exactly."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 97, 211), photo_like(nrng, 640, 480)]
    proc = hf_processor("qwen2-vl", backend)
    text = prompt_text(2)
    ref = hf_reference(proc, text, images, uint8=False)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    for mode in ("hf", "native"):
        config = MultiModalConfig(mm_device_do_normalize=False, transform=mode)
        out = build_processor("qwen2-vl", proc, config=config).apply(prompt_ids, {"image": images})
        assert out.normalization is None
        pv = out.merged_kwargs()["pixel_values"]
        assert pv.dtype == torch.float32
        assert torch.equal(pv, ref["pixel_values"]), f"{backend}/{mode} seed={SEED}"
