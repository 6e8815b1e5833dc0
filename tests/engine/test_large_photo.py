"""A 48-megapixel phone photo (8064 x 6048 JPEG) through an Engine on its default limits: taken
(as vLLM takes it) and equal to the HF processor, which scales it down."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
import torch
from parity import hf_processor

from aiomm import Engine, EngineConfig, Request
from aiomm.media.samples import encode, photo_like

PROMPT = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|> describe<|im_end|>"


@pytest.fixture(scope="module")
def photo() -> bytes:
    return encode(photo_like(np.random.default_rng(48), 6048, 8064), "JPEG")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
async def test_a_48_megapixel_jpeg_equals_the_hf_processor(photo: bytes, backend: str) -> None:
    async with Engine.from_pretrained("qwen2-vl", EngineConfig(), backend=backend) as engine:
        result = await engine.process(Request(prompt=PROMPT, images=[photo]), device=False)
    assert result.ok, result.error

    proc = hf_processor("qwen2-vl", backend)
    with PIL.Image.open(io.BytesIO(photo)) as image:
        rgb = image.convert("RGB")
    assert rgb.size == (8064, 6048)
    want = proc(
        text=[PROMPT], images=[rgb], do_rescale=False, do_normalize=False, return_tensors="pt"
    )
    assert result.prompt_token_ids == want["input_ids"][0].tolist()
    grid = result.mm_kwargs["image_grid_thw"]
    assert torch.equal(grid, want["image_grid_thw"])
    assert int(grid.prod()) * 14 * 14 <= proc.image_processor.size["longest_edge"]  # scaled down
    pixels = result.mm_kwargs["pixel_values"]
    assert pixels.dtype == torch.uint8
    assert torch.equal(pixels.to(want["pixel_values"].dtype), want["pixel_values"])
