"""The stages as the engine composes them: seams, bounds, counts and errors that say where."""

from __future__ import annotations

import types
from typing import Any

import anyio
import numpy as np
import PIL.Image
import pytest

from aiomm.cache.item_cache import CacheOutcome
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import DecodeError, FetchError, InvalidSourceError, ProcessingError
from aiomm.media.fetch import FetchStatistics
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt(n: int) -> str:
    return " ".join(["describe", *[PH] * n])


def jpeg(seed: int) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), 64, 80), "JPEG")


class FakeFetcher:
    """The fetcher seam: answers from a dict; ``slow://`` style network URLs wait for a gate."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.gate = anyio.Event()
        self.network_waiting = 0
        self.fetched: list[Any] = []

    async def fetch(self, source: Any) -> bytes:
        self.fetched.append(source)
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(source)
        if source.startswith("https://slow."):
            self.network_waiting += 1
            await self.gate.wait()
        if source not in self.files:
            raise FetchError(f"no such file {source!r}")
        return self.files[source]

    def statistics(self) -> FetchStatistics:
        return FetchStatistics(len(self.fetched), 0, types.MappingProxyType({}), 0, 0)


async def test_a_fetcher_and_a_decoder_plug_in_without_patching(make_processor) -> None:
    fetcher = FakeFetcher({"https://example.test/a.jpg": jpeg(1)})
    config = EngineConfig(device="cpu")
    async with Engine(make_processor(), config, fetcher=fetcher) as engine:
        first = await engine.process(
            Request(prompt=prompt(1), images=["https://example.test/a.jpg"])
        )
        second = await engine.process(Request(prompt=prompt(1), images=[jpeg(1)]))
    assert fetcher.fetched[0] == "https://example.test/a.jpg"
    assert first.cache == [CacheOutcome.MISS] and second.cache == [CacheOutcome.HIT]
    assert first.item_hashes == second.item_hashes  # keyed by content, not by source


async def test_inline_images_never_wait_behind_slow_downloads(make_processor) -> None:
    files = {f"https://slow.test/{i}.jpg": jpeg(i) for i in range(3)}
    fetcher = FakeFetcher(files)
    config = EngineConfig(device="cpu", fetch_concurrency=1)
    async with Engine(make_processor(), config, fetcher=fetcher) as engine:
        async with anyio.create_task_group() as tg:
            for url in files:
                tg.start_soon(engine.process, Request(prompt=prompt(1), images=[url]))
            await anyio.wait_all_tasks_blocked()
            assert fetcher.network_waiting == 1  # one network slot, taken
            queues = engine.stats().queues  # the others wait for the network lane (admission)
            assert queues["fetch"].waiting + queues["network"].waiting == 2
            data_url = "data:image/jpeg;base64,AAAA"  # handled by the fetcher, no slot needed
            fetcher.files[data_url] = jpeg(9)
            with anyio.fail_after(10):
                inline = await engine.process(Request(prompt=prompt(2), images=[jpeg(8), data_url]))
            assert inline.ok
            fetcher.gate.set()


async def test_errors_name_the_request_and_the_item(make_processor) -> None:
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        request = Request(prompt=prompt(3), images=[jpeg(1), b"not an image", jpeg(2)])
        with pytest.raises(DecodeError) as info:
            await engine.process(Request(**{**request.__dict__, "request_id": "req-7"}))
        assert info.value.request_id == "req-7" and info.value.item_index == 1
        assert "req-7" in str(info.value) and "1" in str(info.value)
        result = await engine.process_safe(request)
        assert isinstance(result.error, DecodeError) and result.error.item_index == 1
        assert result.error.request_id == result.request_id
        # an error of the request as a whole names no item
        with pytest.raises(ProcessingError) as info:
            await engine.process(Request(prompt=prompt(2), images=[jpeg(1)], request_id="r2"))
        assert info.value.request_id == "r2" and info.value.item_index is None


async def test_a_malformed_url_is_a_typed_error_not_a_group(make_processor) -> None:
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        result = await engine.process_safe(
            Request(prompt=prompt(2), images=[jpeg(1), "http://[::1"], request_id="bad-url")
        )
    assert isinstance(result.error, InvalidSourceError), repr(result.error)
    assert result.error.item_index == 1 and "http://[::1" in str(result.error)


async def test_cancelled_requests_are_counted(make_processor) -> None:
    fetcher = FakeFetcher({"https://slow.test/x.jpg": jpeg(1)})
    async with Engine(make_processor(), EngineConfig(device="cpu"), fetcher=fetcher) as engine:
        with anyio.move_on_after(0.2):
            await engine.process(Request(prompt=prompt(1), images=["https://slow.test/x.jpg"]))
        stats = engine.stats()
    assert (stats.requests_started, stats.requests_cancelled, stats.requests_failed) == (1, 1, 0)


async def test_in_memory_images_are_bounded_by_max_pixels(make_processor) -> None:
    from aiomm.config import DecodeConfig
    from aiomm.errors import ImageTooLargeError

    config = EngineConfig(device="cpu", decode=DecodeConfig(max_pixels=1000))
    big = PIL.Image.new("RGB", (40, 40))
    async with Engine(make_processor(), config) as engine:
        with pytest.raises(ImageTooLargeError) as info:
            await engine.process(Request(prompt=prompt(1), images=[big]))
    assert info.value.item_index == 0
