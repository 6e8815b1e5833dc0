"""adapters/paddleocr_vl.py: PaddleOCR-VL's resize and patches against transformers'
``PaddleOCRVLProcessor`` (``PaddleOCRVLImageProcessor`` and its PIL variant), and the prompt and
items vLLM 0.33 builds."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from aiomm.adapters import build_processor, get_adapter_info
from aiomm.adapters.paddleocr_vl import (
    IMAGE_PLACEHOLDER,
    PaddleOCRVLMultiModalProcessor,
    build_hf_processor,
    smart_resize,
)
from aiomm.errors import AspectRatioError, UnknownModalityError
from aiomm.media.samples import photo_like
from aiomm.processing.fields import FieldKind
from aiomm.processing.processor import MultiModalConfig

BACKENDS = ("torchvision", "pil")
#: tiny, thin (scaled up to one 28-pixel unit first), exact multiples, photos, above the bound
SIZES = [
    (1, 1), (1, 2), (3, 5), (7, 1), (1, 150), (150, 1), (8, 1500), (27, 29), (28, 28),
    (29, 27), (240, 320), (384, 384), (480, 640), (700, 20), (1080, 1920), (2000, 3000),
]  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def hf(request: pytest.FixtureRequest) -> object:
    return build_hf_processor(backend=request.param)


def _processor(hf: object, *, device: bool = False, mode: str = "native") -> object:
    config = MultiModalConfig(transform=mode, mm_device_do_normalize=device)
    return build_processor("paddleocr-vl", hf, config=config)


def _prompt(hf: object, n: int) -> list[int]:
    return hf.tokenizer("user " + IMAGE_PLACEHOLDER * n + " describe")["input_ids"]


def test_registered_with_the_checkpoints_parameters() -> None:
    info = get_adapter_info("PaddleOCRVLForConditionalGeneration")
    assert info.short_name == "paddleocr-vl"
    assert info.processor_cls is PaddleOCRVLMultiModalProcessor
    assert info.example_models == "PaddlePaddle/PaddleOCR-VL"
    # vLLM's PaddleOCR-VL takes normalised pixels (no mm_device_do_normalize)
    assert info.mm_device_do_normalize is False
    ip = build_hf_processor().image_processor
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (147384, 2822400)
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 1)
    assert list(ip.image_mean) == list(ip.image_std) == [0.5, 0.5, 0.5]


def test_smart_resize_equals_transformers() -> None:
    """Every thin shape, exact multiples, random sizes, under several pixel bounds; the same
    refusals (transformers' ValueError, ours typed)."""
    from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import (
        smart_resize as hf_smart_resize,
    )

    rng = random.Random(20261206)
    sizes = [(1, w) for w in range(1, 300)] + [(h, 1) for h in range(1, 300)]
    sizes += [(28 * r, 28 * c) for r in range(1, 40, 3) for c in range(1, 40, 5)]
    sizes += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(2000)]
    bounds = [(147384, 2822400), (3136, 12845056), (56 * 56, 200000), (784, 784)]
    for (h, w), (lo, hi) in ((s, b) for s in sizes for b in bounds):
        try:
            theirs = hf_smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)
        except ValueError:
            with pytest.raises(AspectRatioError):
                smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)
            continue
        assert smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi) == theirs, (h, w)


def test_a_thin_image_is_refused_naming_its_own_size() -> None:
    # 8x2000 scales to 28x7000 first: an aspect ratio of 250
    with pytest.raises(AspectRatioError) as info:
        smart_resize(8, 2000, factor=28, min_pixels=147384, max_pixels=2822400)
    assert (info.value.height, info.value.width, info.value.ratio) == (8, 2000, 250)


@pytest.mark.parametrize("device", [False, True])
def test_items_equal_transformers_bit_for_bit(hf: object, device: bool) -> None:
    nrng = np.random.default_rng(7)
    proc = _processor(hf, device=device)
    for h, w in SIZES:
        image = photo_like(nrng, h, w)
        kwargs = {"do_rescale": False, "do_normalize": False} if device else {}
        ref = hf.image_processor([image], return_tensors="pt", **kwargs)
        out = proc.apply(_prompt(hf, 1), {"image": [image]}, {})
        merged = out.merged_kwargs()
        assert torch.equal(merged["image_grid_thw"], ref["image_grid_thw"]), (h, w)
        pv = merged["pixel_values"]
        assert pv.dtype == (torch.uint8 if device else torch.float32), (h, w)
        assert torch.equal(pv.to(ref["pixel_values"].dtype), ref["pixel_values"]), (h, w)
        assert (out.normalization is not None) is device


def test_prompt_ids_and_ranges_equal_transformers(hf: object) -> None:
    """Each placeholder token becomes prod(grid) / merge**2 of them (HF's input_ids); the range
    is those tokens, every one an embedding (vLLM's PromptReplacement of the token)."""
    nrng = np.random.default_rng(3)
    images = [photo_like(nrng, h, w) for h, w in [(240, 320), (8, 1500), (1080, 1920)]]
    text = "user " + IMAGE_PLACEHOLDER * 3 + " describe"
    ref = hf(text=[text], images=images, return_tensors="pt")
    out = _processor(hf).apply(_prompt(hf, 3), {"image": images}, {})
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    token = hf.image_token_id
    grids = ref["image_grid_thw"].tolist()
    ranges = out.mm_placeholders["image"]
    for r, (t, gh, gw) in zip(ranges, grids, strict=True):
        assert r.length == t * gh * gw // 4
        assert set(out.prompt_token_ids[r.offset : r.offset + r.length]) == {token}
        assert r.is_embed is None or bool(r.is_embed.all())


def test_items_are_laid_out_as_vllm_sends_them(hf: object) -> None:
    nrng = np.random.default_rng(5)
    images = [photo_like(nrng, 100, 200), photo_like(nrng, 640, 480)]
    out = _processor(hf).apply(_prompt(hf, 2), {"image": images}, {})
    for item in out.mm_kwargs["image"]:
        gt, gh, gw = item.data["image_grid_thw"].tolist()
        assert tuple(item.data["pixel_values"].shape) == (gt * gh * gw, 3, 14, 14)
        assert item.fields["pixel_values"].kind is FieldKind.FLAT
        assert item.fields["image_grid_thw"].kind is FieldKind.BATCHED


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_pixels": 3136, "max_pixels": 200000},
        {"size": {"shortest_edge": 56 * 56, "longest_edge": 300000}},
        {"temporal_patch_size": 2},
    ],
)
def test_kwargs_equal_transformers(hf: object, kwargs: dict[str, object]) -> None:
    nrng = np.random.default_rng(11)
    images = [photo_like(nrng, 333, 500), photo_like(nrng, 20, 700)]
    text = "user " + IMAGE_PLACEHOLDER * 2 + " describe"
    with warnings.catch_warnings():  # transformers deprecates min_pixels/max_pixels in a call
        warnings.simplefilter("ignore", FutureWarning)
        ref = hf(text=[text], images=images, return_tensors="pt", **kwargs)
    for mode in ("hf", "native"):
        out = _processor(hf, mode=mode).apply(_prompt(hf, 2), {"image": images}, kwargs)
        merged = out.merged_kwargs()
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), mode
        assert torch.equal(merged["image_grid_thw"], ref["image_grid_thw"]), mode
        assert torch.equal(merged["pixel_values"], ref["pixel_values"]), mode


def test_plans_equal_the_render(hf: object) -> None:
    nrng = np.random.default_rng(13)
    proc = _processor(hf)
    for h, w in SIZES:
        image = photo_like(nrng, h, w)
        out = proc.apply(_prompt(hf, 1), {"image": [image]}, {})
        plan = proc.plan_image(h, w, {})
        assert torch.equal(plan.data["image_grid_thw"], out.merged_kwargs()["image_grid_thw"][0])


def test_videos_are_refused(hf: object) -> None:
    proc = _processor(hf)
    assert proc.supported_modalities == ("image",)
    frames = np.zeros((4, 32, 32, 3), np.uint8)
    with pytest.raises(UnknownModalityError):
        proc.apply(_prompt(hf, 0), {"video": [frames]}, {})
