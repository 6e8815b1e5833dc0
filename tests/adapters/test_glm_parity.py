"""Parity of the GLM-V adapters (GLM-4V, GLM-OCR, GLM-5-Next) with the HF processors they reproduce.

Every run draws fresh random images (the seed is printed on failure): tiny, thin, large, 1 to 4
images per prompt. For both HF backends (torchvision and PIL) and both of our transforms (``hf``
and ``native``): token ids equal HF's ``input_ids``, placeholder ranges cover exactly the image
tokens, grids are equal, uint8 ``pixel_values`` equal HF's output with rescale/normalise disabled
bit for bit, and after ``FusedMMInputNorm`` they equal HF's default float output to a norm-wise
relative error under 1e-6.
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
from aiomm.errors import ItemCountMismatchError, ProcessingError, ProcessorKwargsError
from aiomm.processing.processor import MultiModalConfig
from aiomm.samples import photo_like

GLM_FAMILY = ("glm-4v", "glm-ocr", "glm-5-next")
BACKENDS = ("torchvision", "pil")
PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"


SIZES_SMALL = [(1, 1), (3, 5), (28, 28), (57, 33), (1, 150), (150, 1), (199, 3), (240, 320),
               (333, 500), (480, 640), (700, 20), (27, 29)]  # fmt: skip
SIZES_LARGE = [(1080, 1920), (1536, 2048)]


def draw_sizes(rng: random.Random, count: int, *, large: bool) -> list[tuple[int, int]]:
    pool = SIZES_SMALL + (SIZES_LARGE if large else [])
    return parity.draw_sizes(rng, count, pool, max_aspect=150)  # GLM rejects ratios above 200


def prompt_text(n_images: int) -> str:
    return parity.prompt_text(n_images, PLACEHOLDER, start="<|user|>", end="<|assistant|>")


def hf_reference(
    proc: Any, text: str, images: list[Any], uint8: bool, kwargs: dict[str, Any]
) -> dict[str, Any]:
    extra = {"do_rescale": False, "do_normalize": False} if uint8 else {}
    # mm_token_type_ids (not compared) would make numpy warn about torch's __array__.
    return proc(
        text=[text], images=images, return_tensors="pt", return_mm_token_type_ids=False,
        **kwargs, **extra,
    )  # fmt: skip


def check_case(
    name: str,
    backend: str,
    n_images: int,
    case_seed: int,
    *,
    large: bool = False,
    sizes: list[tuple[int, int]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> None:
    kwargs = kwargs or {}
    rng = random.Random(case_seed)
    nrng = np.random.default_rng(case_seed)
    sizes = sizes or draw_sizes(rng, n_images, large=large)
    images = [photo_like(nrng, h, w) for h, w in sizes]
    ctx = f"[{name}/{backend} seed={case_seed} sizes={sizes} kwargs={kwargs}]"

    proc = hf_processor(name, backend)
    text = prompt_text(n_images)
    ref_u8 = hf_reference(proc, text, images, True, kwargs)
    ref_f = hf_reference(proc, text, images, False, kwargs)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    assert prompt_ids.count(proc.image_token_id) == n_images
    image_token = proc.image_token_id
    expected_ids = ref_u8["input_ids"][0].tolist()
    merge = proc.image_processor.merge_size

    outputs = {}
    for mode in ("hf", "native"):
        ours = build_processor(name, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"image": images}, kwargs)
        merged = out.merged_kwargs()
        assert out.prompt_token_ids == expected_ids, f"{ctx} {mode}: token ids differ"
        assert torch.equal(merged["image_grid_thw"], ref_u8["image_grid_thw"]), f"{ctx} grid"

        ranges = out.mm_placeholders["image"]
        assert len(ranges) == n_images, ctx
        covered = sorted(i for r in ranges for i in range(r.offset, r.offset + r.length))
        expected_pos = [i for i, t in enumerate(expected_ids) if t == image_token]
        assert covered == expected_pos, f"{ctx} {mode}: placeholder ranges"
        for r, grid in zip(ranges, ref_u8["image_grid_thw"], strict=True):
            assert r.length == int(grid.prod()) // merge**2 and r.is_embed is None, ctx

        pv = merged["pixel_values"]
        assert pv.dtype == torch.uint8, f"{ctx} {mode}: {pv.dtype}"
        ref_pv = ref_u8["pixel_values"]
        assert pv.shape == ref_pv.shape, f"{ctx} {mode}: {pv.shape} vs {ref_pv.shape}"
        assert torch.equal(pv.double(), ref_pv.double()), f"{ctx} {mode}: uint8 differs from HF"

        norm = out.normalization
        assert norm is not None and norm.layout.name == "PATCHES", ctx
        normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
        err = rel_err(normalised, ref_f["pixel_values"])
        assert err < 1e-6, f"{ctx} {mode}: normalised rel err {err:.3g}"
        outputs[mode] = pv
    assert torch.equal(outputs["hf"], outputs["native"]), f"{ctx}: native != hf"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", GLM_FAMILY)
def test_parity_small_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-{name}-{backend}")
    for n_images in (1, 2, 3, 4):
        check_case(name, backend, n_images, rng.randrange(2**31))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["glm-4v", "glm-5-next"])
def test_parity_large_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-large-{name}-{backend}")
    check_case(name, backend, 2, rng.randrange(2**31), large=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        # a small pixel budget: the scale-down branch of smart_resize on small images
        ("glm-4v", {"size": {"shortest_edge": 3136, "longest_edge": 50000}}),
        # a large minimum: the scale-up branch
        ("glm-ocr", {"size": {"shortest_edge": 400000, "longest_edge": 9633792}}),
        # a small token budget: GLM-5-Next's binary search down into the budget
        ("glm-5-next", {"max_image_tokens": 40}),
        # a large minimum: GLM-5-Next scales up small images and pads
        ("glm-5-next", {"min_image_tokens": 300}),
        # torchvision widens the canvas factor, PIL ignores it: both are reproduced
        ("glm-5-next", {"patch_expand_factor": 2}),
    ],
)
def test_parity_with_processor_kwargs(name: str, kwargs: dict[str, Any], backend: str) -> None:
    rng = random.Random(f"{SEED}-kwargs-{name}-{kwargs}-{backend}")
    check_case(name, backend, 3, rng.randrange(2**31), kwargs=kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["glm-4v", "glm-5-next"])
def test_classic_cpu_path_native_equals_hf_float(name: str, backend: str) -> None:
    """With mm_device_do_normalize off, both transforms return HF's float output exactly."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 97, 211), photo_like(nrng, 640, 480), photo_like(nrng, 5, 9)]
    proc = hf_processor(name, backend)
    text = prompt_text(3)
    ref = hf_reference(proc, text, images, False, {})
    prompt_ids = proc.tokenizer(text)["input_ids"]
    for mode in ("hf", "native"):
        config = MultiModalConfig(mm_device_do_normalize=False, transform=mode)
        out = build_processor(name, proc, config=config).apply(prompt_ids, {"image": images})
        assert out.normalization is None
        assert out.prompt_token_ids == ref["input_ids"][0].tolist()
        pv = out.merged_kwargs()["pixel_values"]
        assert pv.dtype == torch.float32
        assert torch.equal(pv, ref["pixel_values"]), f"{name}/{backend}/{mode} seed={SEED}"


def test_items_do_not_depend_on_the_batch() -> None:
    """An item processed alone equals the same item processed with others (what a cache keeps)."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 120, 90), photo_like(nrng, 300, 410)]
    ours = build_processor("glm-5-next", hf_processor("glm-5-next", "torchvision"))
    together = ours.process_items({"image": images}, {})["image"]
    for image, item in zip(images, together, strict=True):
        alone = ours.process_items({"image": [image]}, {})["image"][0]
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(alone.data[key], item.data[key]), f"{key} seed={SEED}"


def test_registry_lists_the_glm_family_with_defaults() -> None:
    names = {i.short_name: i for i in supported_adapters()}
    for short, arch in (("glm-4v", "Glm4vForConditionalGeneration"),
                        ("glm-ocr", "GlmOcrForConditionalGeneration"),
                        ("glm-5-next", "Glm5NextForConditionalGeneration")):  # fmt: skip
        assert names[short].mm_device_do_normalize is True
        assert names[short].architecture == arch
        assert get_adapter_info(arch) is names[short]
    assert type(hf_processor("glm-ocr", "pil")).__name__ == "Glm46VProcessor"


@pytest.mark.parametrize("mode", ["hf", "native"])
def test_fewer_placeholders_than_images(mode: str) -> None:
    proc = hf_processor("glm-4v", "torchvision")
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 40, 60), photo_like(nrng, 70, 50)]
    ours = build_processor("glm-4v", proc, config=MultiModalConfig(transform=mode))
    with pytest.raises(ItemCountMismatchError) as info:
        ours.apply(proc.tokenizer(prompt_text(1))["input_ids"], {"image": images})
    assert info.value.num_items == 2 and info.value.num_placeholders == 1


@pytest.mark.parametrize("mode", ["hf", "native"])
def test_extreme_aspect_ratio_is_rejected(mode: str) -> None:
    proc = hf_processor("glm-4v", "pil")
    ours = build_processor("glm-4v", proc, config=MultiModalConfig(transform=mode))
    image = photo_like(np.random.default_rng(SEED), 2, 700)
    with pytest.raises(ProcessingError, match="aspect ratio"):
        ours.apply(proc.tokenizer(prompt_text(1))["input_ids"], {"image": [image]})


def test_ignored_kwargs_are_rejected() -> None:
    ours = build_processor("glm-5-next", hf_processor("glm-5-next", "torchvision"))
    with pytest.raises(ProcessorKwargsError, match="size"):
        ours.validate_hf_kwargs({"size": {"shortest_edge": 1, "longest_edge": 2}})
    glm4v = build_processor("glm-4v", hf_processor("glm-4v", "torchvision"))
    glm4v.validate_hf_kwargs({"size": {"shortest_edge": 1, "longest_edge": 2}, "merge_size": 2})
    with pytest.raises(ProcessorKwargsError, match="min_image_tokens"):
        glm4v.validate_hf_kwargs({"min_image_tokens": 4})
