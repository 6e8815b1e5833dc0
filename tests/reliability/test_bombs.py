"""Decompression bombs through the engine: the byte budget counts a decode's real peak, and the
pixel limit is derived from what the adapter keeps."""

from __future__ import annotations

import io

import anyio
import PIL.Image
import pytest
from counting_decoder import ConcurrencyDecoder

from aiomm.config import DecodeConfig, EngineConfig
from aiomm.engine import Engine
from aiomm.errors import ImageTooLargeError
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def png(mode: str, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


async def test_budget_admits_a_decode_by_its_real_peak(make_processor) -> None:
    one_bit = png("1", (2048, 2048))  # ~4 KB that decodes to 12 bytes a pixel at peak
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        await engine.process(Request(prompt=PH, images=[one_bit]))
        peak = engine.stats().decoded_bytes.peak
    assert peak >= 11 * 2048 * 2048 > 3 * 2048 * 2048


async def test_budget_serialises_bombs_that_fit_only_one_at_a_time(make_processor) -> None:
    one_bit = [png("1", (1024 + i, 1024)) for i in range(4)]  # distinct: no cache joins
    # room for one 1-bit decode at its real cost, but for all four at W*H*3
    config = EngineConfig(
        device="cpu", transform_threads=4, max_decoded_bytes_in_flight=14 * 1024 * 1024
    )
    decoder = ConcurrencyDecoder()
    async with Engine(make_processor(), config, decoder=decoder) as engine:
        async with anyio.create_task_group() as tg:
            for data in one_bit:
                tg.start_soon(engine.process, Request(prompt=PH, images=[data]))
        stats = engine.stats().decoded_bytes
    assert decoder.most == 1
    assert 11 * 1024 * 1024 <= stats.peak <= config.max_decoded_bytes_in_flight


def test_max_pixels_default_is_derived_from_the_adapter(make_processor) -> None:
    qwen = make_processor()  # keeps at most size.longest_edge pixels
    assert qwen.max_kept_pixels() == qwen.hf_processor.image_processor.size.longest_edge
    assert Engine(qwen, EngineConfig(device="cpu")).max_pixels == 24 * 2**20
    mistral = make_processor("mistral3")
    assert mistral.max_kept_pixels() == 1540 * 1540
    qwen3 = make_processor("qwen3-vl")
    assert Engine(qwen3, EngineConfig(device="cpu")).max_pixels == 2 * 16777216
    explicit = EngineConfig(device="cpu", decode=DecodeConfig(max_pixels=10**8))
    assert Engine(qwen, explicit).max_pixels == 10**8


async def test_an_image_above_the_derived_limit_is_refused_unread(make_processor) -> None:
    # 6000 x 4500 = 27 Mpx: under the old 64 Mi default, over qwen2-vl's derived 24 Mi
    data = png("1", (6000, 4500))
    config = EngineConfig(device="cpu", decode=DecodeConfig(max_pixels_per_byte=None))
    async with Engine(make_processor(), config) as engine:
        with pytest.raises(ImageTooLargeError, match="above the limit of 25165824 pixels"):
            await engine.process(Request(prompt=PH, images=[data]))
        assert engine.stats().decoded_bytes.peak == 0
