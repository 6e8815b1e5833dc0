"""Gemma 4's adapter: target sizes and soft-token counts against transformers' for many sizes
(arithmetic only), the prompt replacement vLLM builds, the item layout, and refusals."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

from aiomm.adapters import build_processor, get_adapter_info
from aiomm.adapters.gemma4 import (
    SUPPORTED_SOFT_TOKENS,
    gemma4_num_soft_tokens,
    gemma4_target_size,
)
from aiomm.errors import ProcessorKwargsError, UnknownModalityError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig

#: sides from 1 px to 8K, with 48-px multiples and their neighbours (the rounding edges)
SIDES = sorted({1, 2, 3, 5, 7, 16, 33, 47, 48, 49, 95, 96, 97, 150, 224, 333, 480, 500, 640,
                767, 768, 769, 803, 804, 1080, 1920, 2048, 4000, 7680})  # fmt: skip


@pytest.fixture(scope="module")
def hf_processor() -> Any:
    return get_adapter_info("gemma4").build_hf_processor()


@pytest.fixture(scope="module")
def processor(hf_processor: Any) -> Any:
    return build_processor("gemma4", hf_processor, config=MultiModalConfig(transform="native"))


@pytest.mark.parametrize("max_soft_tokens", SUPPORTED_SOFT_TOKENS)
def test_target_size_and_token_count_match_transformers(max_soft_tokens: int) -> None:
    """The resize target equals transformers'; vLLM's prompt count (restated here) equals the
    patches the transform keeps, divided by the 3 x 3 pooling, for every pair of sides."""
    max_patches = max_soft_tokens * 9
    for h, w in itertools.product(SIDES, SIDES):
        expected = get_aspect_ratio_preserving_size(h, w, 16, max_patches, 3)
        got = gemma4_target_size(h, w, patch_size=16, max_patches=max_patches,
                                 pooling_kernel_size=3)  # fmt: skip
        assert got == expected, (h, w, max_soft_tokens)
        th, tw = got
        assert th % 48 == 0 and tw % 48 == 0 and (th // 16) * (tw // 16) <= max_patches
        tokens = gemma4_num_soft_tokens(
            h, w, patch_size=16, pooling_kernel_size=3, max_soft_tokens=max_soft_tokens
        )
        assert tokens == (th // 16) * (tw // 16) // 9, (h, w, max_soft_tokens)


def test_token_count_matches_the_hf_processor(hf_processor: Any) -> None:
    sizes = [[h, w] for h, w in itertools.product(SIDES[::3], SIDES[::2])]
    counts = hf_processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    ours = [
        gemma4_num_soft_tokens(h, w, patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)
        for h, w in sizes
    ]
    assert ours == counts


def _prompt(processor: Any, n: int) -> list[int]:
    tok = processor.hf_processor.tokenizer
    return tok.encode("user describe " + " ".join(["<|image|>"] * n) + " assistant")


def test_prompt_replacement_and_item_layout(processor: Any) -> None:
    rng = np.random.default_rng(0)
    images = [photo_like(rng, 240, 320), photo_like(rng, 20, 700)]
    prompt = _prompt(processor, 2)
    out = processor.apply(prompt, {"image": images}, {})
    boi, image, eoi = processor.boi_token_id, processor.image_token_id, processor.eoi_token_id
    expected_counts = [
        gemma4_num_soft_tokens(h, w, patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)
        for h, w in ((240, 320), (20, 700))
    ]
    ranges = out.mm_placeholders["image"]
    for r, n in zip(ranges, expected_counts, strict=True):
        tokens = out.prompt_token_ids[r.offset : r.offset + r.length]
        assert tokens == [boi, *[image] * n, eoi]
        assert r.is_embed is not None and list(r.is_embed) == [False, *[True] * n, False]
    assert out.prompt_token_ids.count(image) == sum(expected_counts)

    for item, n in zip(out.mm_kwargs["image"], expected_counts, strict=True):
        assert list(item.data) == ["pixel_values", "pixel_position_ids"]
        pixels, positions = item.data["pixel_values"], item.data["pixel_position_ids"]
        assert pixels.shape == (2520, 768) and pixels.dtype == torch.float32
        assert positions.shape == (2520, 2) and positions.dtype == torch.long
        real = n * 9
        assert (positions[:real] >= 0).all() and (positions[real:] == -1).all()
        assert not pixels[real:].any()
        # raster order: x runs fastest
        cols = int(positions[:real, 0].max()) + 1
        assert positions[1, 0] == (1 if cols > 1 else 0)
        assert positions[cols].tolist() == [0, 1]


@pytest.mark.parametrize("max_soft_tokens", [70, 1120])
def test_max_soft_tokens_per_request(processor: Any, max_soft_tokens: int) -> None:
    image = photo_like(np.random.default_rng(1), 600, 800)
    kwargs = {"max_soft_tokens": max_soft_tokens}
    out = processor.apply(_prompt(processor, 1), {"image": [image]}, kwargs)
    (r,) = out.mm_placeholders["image"]
    n = gemma4_num_soft_tokens(
        600, 800, patch_size=16, pooling_kernel_size=3, max_soft_tokens=max_soft_tokens
    )
    assert r.length == n + 2
    assert out.mm_kwargs["image"][0].data["pixel_values"].shape[0] == max_soft_tokens * 9
    plan = processor.plan_image(600, 800, kwargs)
    assert plan.prompt_data["tokens"] == out.mm_kwargs["image"][0].prompt_data["tokens"] == n


@pytest.mark.parametrize(
    "kwargs", [{"max_soft_tokens": 100}, {"patch_size": 14}, {"pooling_kernel_size": 2}]
)
def test_refused_kwargs(processor: Any, kwargs: dict[str, Any]) -> None:
    image = photo_like(np.random.default_rng(2), 32, 32)
    with pytest.raises(ProcessorKwargsError):
        processor.apply(_prompt(processor, 1), {"image": [image]}, kwargs)
    with pytest.raises(ProcessorKwargsError):
        processor.validate_hf_kwargs(kwargs)


@pytest.mark.parametrize("modality", ["video", "audio"])
def test_videos_and_audio_are_refused(processor: Any, modality: str) -> None:
    with pytest.raises(UnknownModalityError):
        processor.apply(_prompt(processor, 0), {modality: [np.zeros((2, 32, 32, 3), np.uint8)]})
