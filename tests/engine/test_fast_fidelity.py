"""DecodeConfig(fidelity="fast"): reduced JPEG decode, same target, separate cache keys, PSNR."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
import torch

from aiomm.config import DecodeConfig, EngineConfig
from aiomm.engine import Engine
from aiomm.errors import ConfigError
from aiomm.media.image import decode_image
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user describe {PH}<|im_end|>"
# a small pixel budget, so a 768 x 1024 photo resizes to well under half its size
KWARGS = {"size": {"shortest_edge": 3136, "longest_edge": 160 * 224}}


def _photo(seed: int, h: int = 768, w: int = 1024) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), h, w), "JPEG", quality=90)


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_fidelity_is_validated() -> None:
    assert DecodeConfig().fidelity == "exact"
    with pytest.raises(ConfigError, match="fidelity"):
        DecodeConfig(fidelity="quick")  # type: ignore[arg-type]


def test_reduced_decode_is_smaller_and_never_below_the_target() -> None:
    data = _photo(1)
    full = decode_image(data, max_pixels=10**8)
    reduced = decode_image(data, max_pixels=10**8, reduce_to=(150, 200))
    assert full.shape == (768, 1024, 3)
    assert reduced.shape == (192, 256, 3)  # 1/4 scale: 1/8 would fall below 150 x 200
    # a target above half the source, or a PNG, decodes at full size
    assert decode_image(data, max_pixels=10**8, reduce_to=(400, 600)).shape == full.shape
    png = encode(photo_like(np.random.default_rng(1), 768, 1024), "PNG")
    assert decode_image(png, max_pixels=10**8, reduce_to=(150, 200)).shape == full.shape


async def _run(make_processor, fidelity: str, images: list[bytes]):
    config = EngineConfig(device="cpu", decode=DecodeConfig(fidelity=fidelity), return_items=True)
    async with Engine(make_processor(transform="native"), config) as engine:
        return [
            await engine.process(Request(prompt=PROMPT, images=[i], mm_processor_kwargs=KWARGS))
            for i in images
        ]


async def test_fast_mode_matches_exact_within_40_db(make_processor) -> None:
    images = [_photo(seed) for seed in range(3)]
    exact = await _run(make_processor, "exact", images)
    fast = await _run(make_processor, "fast", images)
    for e, f in zip(exact, fast, strict=True):
        assert e.ok and f.ok and e.fidelity == "exact" and f.fidelity == "fast"
        # the same target: same grid, same token count, same placeholder ranges
        assert e.prompt_token_ids == f.prompt_token_ids
        assert torch.equal(e.items[0].data["image_grid_thw"], f.items[0].data["image_grid_thw"])
        a, b = e.items[0].data["pixel_values"], f.items[0].data["pixel_values"]
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
        assert not torch.equal(a, b)  # the reduced decode did happen
        assert _psnr(a, b) > 40
        # fast and exact items never share a cache entry
        assert e.item_hashes != f.item_hashes


async def test_exact_mode_still_equals_the_reference(make_processor) -> None:
    data = _photo(5)
    (result,) = await _run(make_processor, "exact", [data])
    processor = make_processor(transform="native")
    ids = processor.hf_processor.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    decoded = PIL.Image.open(io.BytesIO(data)).convert("RGB")
    reference = processor.apply(ids, {"image": [decoded]}, KWARGS)
    assert torch.equal(
        result.items[0].data["pixel_values"], reference.mm_kwargs["image"][0].data["pixel_values"]
    )
