"""ItemCache: cache lookups, single-flight misses, generations and outcomes."""

from __future__ import annotations

import anyio
import pytest
import torch
from aiocache import SimpleMemoryCache

from aiomm.cache._lru import ByteLRUCache
from aiomm.cache.item_cache import CacheOutcome, ItemCache

pytestmark = pytest.mark.timeout(20)


class Compute:
    """Returns a fresh tensor of ``nbytes`` bytes once released; counts its calls."""

    def __init__(self, nbytes: int = 64) -> None:
        self.nbytes = nbytes
        self.release = anyio.Event()
        self.calls = 0

    async def __call__(self) -> torch.Tensor:
        self.calls += 1
        await self.release.wait()
        return torch.zeros(self.nbytes, dtype=torch.uint8)


async def test_miss_then_hit() -> None:
    compute = Compute()
    compute.release.set()
    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg, capacity_bytes=1024)
        first, outcome = await cache.get_or_compute("k", compute)
        assert outcome is CacheOutcome.MISS
        again, outcome = await cache.get_or_compute("k", compute)
        assert outcome is CacheOutcome.HIT
        assert again is first
        assert cache.peek("k") is first
        assert cache.peek("other") is None
    assert compute.calls == 1
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.joins, stats.uncached) == (1, 1, 0, 0)
    assert (stats.entries, stats.bytes, stats.capacity_bytes) == (1, 64, 1024)


async def test_concurrent_requests_one_miss_the_rest_joined_then_hit() -> None:
    compute = Compute()
    outcomes: list[CacheOutcome] = []
    values: list[torch.Tensor] = []

    async def request() -> None:
        value, outcome = await cache.get_or_compute("k", compute)
        values.append(value)
        outcomes.append(outcome)

    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg)
        async with anyio.create_task_group() as callers:
            for _ in range(50):
                callers.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            compute.release.set()
        value, outcome = await cache.get_or_compute("k", compute)

    assert compute.calls == 1
    assert sorted(o.value for o in outcomes) == ["joined"] * 49 + ["miss"]
    assert all(v is values[0] for v in values)
    assert (value, outcome) == (values[0], CacheOutcome.HIT)
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.joins) == (1, 1, 49)


async def test_clear_during_flight_leaves_the_cache_empty() -> None:
    compute = Compute()
    results: list[tuple[torch.Tensor, CacheOutcome]] = []

    async def request() -> None:
        results.append(await cache.get_or_compute("k", compute))

    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg)
        await cache.backend.set("old", torch.zeros(8, dtype=torch.uint8))
        async with anyio.create_task_group() as callers:
            callers.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            await cache.clear()
            compute.release.set()
        assert cache.peek("k") is None
        assert cache.peek("old") is None
        assert await cache.backend.exists("k") is False

    assert [outcome for _, outcome in results] == [CacheOutcome.UNCACHED]
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.uncached, stats.misses) == (0, 0, 1, 0)


async def test_oversize_result_is_served_uncached() -> None:
    compute = Compute(nbytes=2048)
    compute.release.set()
    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg, capacity_bytes=1024)
        value, outcome = await cache.get_or_compute("big", compute)
        assert outcome is CacheOutcome.UNCACHED
        assert value.nbytes == 2048
        assert cache.peek("big") is None
        _, outcome = await cache.get_or_compute("big", compute)
        assert outcome is CacheOutcome.UNCACHED
    assert compute.calls == 2
    stats = cache.statistics()
    assert (stats.uncached, stats.oversize_skips, stats.entries, stats.bytes) == (2, 2, 0, 0)


async def test_failures_reach_every_request_and_are_not_cached() -> None:
    calls = 0

    async def broken() -> torch.Tensor:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.01)
        raise ValueError("decode failed")

    errors: list[BaseException] = []

    async def request() -> None:
        try:
            await cache.get_or_compute("k", broken)
        except ValueError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg)
        async with anyio.create_task_group() as callers:
            for _ in range(5):
                callers.start_soon(request)
        with pytest.raises(ValueError, match="decode failed"):
            await cache.get_or_compute("k", broken)
    assert len(errors) == 5
    assert calls == 2
    assert cache.statistics().failures == 2
    assert cache.peek("k") is None


async def test_leader_rechecks_the_backend_inside_the_flight() -> None:
    # A remote backend can be filled by another process between the lookup and the flight.
    class RacyBackend(ByteLRUCache):
        async def get(self, key: str, default: object = None, namespace: str | None = None):
            value = await super().get(key, default, namespace)
            if value is None:
                self._store(key, "filled elsewhere", None)
            return value

    compute = Compute()
    compute.release.set()
    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg, RacyBackend(1024))
        value, outcome = await cache.get_or_compute("k", compute)
    assert (value, outcome) == ("filled elsewhere", CacheOutcome.HIT)
    assert compute.calls == 0


async def test_foreign_aiocache_backend_works() -> None:
    compute = Compute()
    compute.release.set()
    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg, SimpleMemoryCache(timeout=None))
        first, outcome = await cache.get_or_compute("k", compute)
        assert outcome is CacheOutcome.MISS
        assert await cache.get_or_compute("k", compute) == (first, CacheOutcome.HIT)
        assert cache.peek("k") is None  # no synchronous peek on this backend
        await cache.clear()
        assert await cache.backend.exists("k") is False
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (1, 1, 0, 0)


class _ReadTwiceTier:
    """A second tier that holds every key and lets the first tier keep one from its second
    read."""

    def __init__(self) -> None:
        self.reads: dict[str, int] = {}

    async def get_or_compute(self, key: str, compute: object) -> tuple[torch.Tensor, str]:
        self.reads[key] = self.reads.get(key, 0) + 1
        return torch.zeros(8, dtype=torch.uint8), "hit"

    def store_hit(self, key: str) -> bool:
        return self.reads[key] >= 2

    def statistics(self) -> None:
        return None


async def test_a_second_tier_decides_which_of_its_hits_are_kept() -> None:
    tier = _ReadTwiceTier()
    compute = Compute()
    async with anyio.create_task_group() as tg:
        cache = ItemCache(tg, capacity_bytes=1024, second_tier=tier)
        outcomes = [(await cache.get_or_compute("k", compute))[1] for _ in range(3)]
        held = cache.statistics().entries
    assert outcomes == [CacheOutcome.SHARED_HIT, CacheOutcome.SHARED_HIT, CacheOutcome.HIT]
    assert tier.reads == {"k": 2} and held == 1 and compute.calls == 0
