"""Overload: beyond max_in_flight + max_waiting requests are shed at once with a typed
OverloadedError and counted; admitted inline-image requests never wait behind slow downloads."""

from __future__ import annotations

import types
from typing import Any

import anyio
import numpy as np
import pytest

from aiomm import OverloadedError
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import ConfigError
from aiomm.media.fetch import FetchStatistics
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"
SLOW = "https://slow.test/x.jpg"


def jpeg(seed: int) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), 64, 80), "JPEG")


class GateFetcher:
    """Network URLs wait for ``gate``; bytes pass through."""

    def __init__(self) -> None:
        self.gate = anyio.Event()

    async def fetch(self, source: Any) -> bytes:
        if isinstance(source, bytes):
            return source
        await self.gate.wait()
        return jpeg(0)

    def statistics(self) -> FetchStatistics:
        return FetchStatistics(0, 0, types.MappingProxyType({}), 0, 0)


async def test_requests_beyond_the_waiting_bound_are_shed_typed(make_processor) -> None:
    fetcher = GateFetcher()
    # network requests hold at most half the slots: a lane of 2
    config = EngineConfig(device="cpu", max_in_flight=4, max_waiting=3, fetch_concurrency=8)
    outcomes: list[str] = []
    async with Engine(make_processor(), config, fetcher=fetcher) as engine:

        async def one(i: int) -> None:
            result = await engine.process_safe(
                Request(prompt=PH, images=[SLOW], request_id=f"r{i}")
            )
            outcomes.append(type(result.error).__name__ if result.error else "ok")

        async with anyio.create_task_group() as tg:
            for i in range(5):  # 2 admitted + 3 waiting
                tg.start_soon(one, i)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(OverloadedError) as info:  # the sixth is shed at once
                await engine.process(Request(prompt=PH, images=[SLOW], request_id="r5"))
            assert info.value.request_id == "r5"
            assert (info.value.in_flight, info.value.waiting) == (2, 3)
            assert "2 requests in flight and 3 waiting" in str(info.value)
            stats = engine.stats()
            assert stats.requests_shed == 1 and stats.queues["network"].waiting == 3
            fetcher.gate.set()
        final = engine.stats()
    assert outcomes == ["ok"] * 5  # every admitted or waiting request still completes
    assert (final.requests_started, final.requests_completed, final.requests_shed) == (5, 5, 1)


async def test_zero_waiting_sheds_as_soon_as_every_slot_is_taken(make_processor) -> None:
    fetcher = GateFetcher()
    config = EngineConfig(device="cpu", max_in_flight=1, max_waiting=0)
    async with Engine(make_processor(), config, fetcher=fetcher) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.process, Request(prompt=PH, images=[SLOW]))
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(OverloadedError):
                await engine.process(Request(prompt=PH, images=[jpeg(1)]))
            fetcher.gate.set()
        # with the slot free again, the same request is admitted
        await engine.process(Request(prompt=PH, images=[jpeg(1)]))


async def test_a_slow_loris_flood_never_takes_every_slot(make_processor) -> None:
    # before: 16 slow downloads held all 16 slots and every inline request behind them was shed
    fetcher = GateFetcher()
    config = EngineConfig(device="cpu", max_in_flight=16, max_waiting=4, fetch_concurrency=32)
    async with Engine(make_processor(), config, fetcher=fetcher) as engine:
        async with anyio.create_task_group() as tg:
            for _ in range(40):  # 8 admitted, 4 waiting, 28 shed
                tg.start_soon(engine.process_safe, Request(prompt=PH, images=[SLOW]))
            await anyio.wait_all_tasks_blocked()
            stats = engine.stats()
            assert stats.queues["network"].in_use == 8 == stats.queues["requests"].in_use
            assert stats.requests_shed == 28
            with anyio.fail_after(10):  # long before any download can finish
                for seed in range(4):
                    assert (
                        await engine.process(Request(prompt=PH, images=[jpeg(seed)]))
                    ).error is None
            fetcher.gate.set()
    assert config.network_slots() == 8


def test_max_waiting_config() -> None:
    assert EngineConfig().waiting_bound() == 16 * 64
    assert EngineConfig(max_in_flight=4, max_waiting=0).waiting_bound() == 0
    with pytest.raises(ConfigError, match="max_waiting"):
        EngineConfig(max_waiting=-1)


async def test_inline_requests_are_not_starved_by_slow_downloads(make_processor) -> None:
    fetcher = GateFetcher()
    config = EngineConfig(device="cpu", max_in_flight=8, fetch_concurrency=2, max_waiting=64)
    async with Engine(make_processor(), config, fetcher=fetcher) as engine:
        async with anyio.create_task_group() as tg:
            for _ in range(6):  # 2 hold the fetch slots, 4 wait for one
                tg.start_soon(engine.process, Request(prompt=PH, images=[SLOW]))
            await anyio.wait_all_tasks_blocked()
            with anyio.fail_after(10):  # long before any download can finish
                for seed in range(2):
                    result = await engine.process(Request(prompt=PH, images=[jpeg(seed)]))
                    assert result.error is None
            assert not fetcher.gate.is_set()
            fetcher.gate.set()
