"""Decompression bombs through the engine: the byte budget counts a decode's real peak, and the
pixel limit is Pillow's bomb limit (vLLM's default), not a refusal of large photos."""

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


def test_max_pixels_default_is_pillows_bomb_limit_for_every_adapter(make_processor) -> None:
    for name in ("qwen2-vl", "qwen3-vl", "mistral3", "glm-4v"):
        engine = Engine(make_processor(name), EngineConfig(device="cpu"))
        assert engine.max_pixels == 2 * PIL.Image.MAX_IMAGE_PIXELS == 178_956_970
    explicit = EngineConfig(device="cpu", decode=DecodeConfig(max_pixels=10**7))
    assert Engine(make_processor(), explicit).max_pixels == 10**7


async def test_an_image_above_pillows_bomb_limit_is_refused_unread(make_processor) -> None:
    data = png("1", (18000, 10000))  # 180 Mpx in 23 KB
    config = EngineConfig(device="cpu", decode=DecodeConfig(max_pixels_per_byte=None))
    async with Engine(make_processor(), config) as engine:
        with pytest.raises(ImageTooLargeError, match="178956970 pixels"):
            await engine.process(Request(prompt=PH, images=[data]))
        assert engine.stats().decoded_bytes.peak == 0


async def test_a_deployments_lower_limit_refuses_large_photos_unread(make_processor) -> None:
    data = png("1", (6000, 4500))  # 27 Mpx
    config = EngineConfig(
        device="cpu", decode=DecodeConfig(max_pixels=24 * 2**20, max_pixels_per_byte=None)
    )
    async with Engine(make_processor(), config) as engine:
        with pytest.raises(ImageTooLargeError, match="above the limit of 25165824 pixels"):
            await engine.process(Request(prompt=PH, images=[data]))
        assert engine.stats().decoded_bytes.peak == 0


async def test_small_pngs_inflating_to_64_mpx_are_decoded_one_at_a_time(make_processor) -> None:
    """8 KB each, 64 Mpx each (8168 pixels a byte, just under the density check): accepted, as
    vLLM accepts them, but the byte budget admits one decode at a time."""
    bombs = [png("1", (8192, 8192 - i)) for i in range(2)]  # distinct: no cache joins
    assert all(len(b) < 8300 for b in bombs)
    config = EngineConfig(device="cpu", transform_threads=2, max_decoded_bytes_in_flight=1 << 30)
    decoder = ConcurrencyDecoder()
    async with Engine(make_processor(), config, decoder=decoder) as engine:
        async with anyio.create_task_group() as tg:
            for data in bombs:
                tg.start_soon(engine.process, Request(prompt=PH, images=[data]))
        stats = engine.stats().decoded_bytes
    assert decoder.most == 1
    assert 11 * 8192 * 8190 <= stats.peak <= config.max_decoded_bytes_in_flight
