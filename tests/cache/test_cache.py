"""ByteLRUCache through the aiocache interface it implements."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aiomm.cache._lru
from aiomm.cache._lru import ByteLRUCache, CacheStatistics, nbytes_of


def tensor(nbytes: int) -> torch.Tensor:
    """A float32 tensor of exactly ``nbytes`` bytes (a multiple of 4)."""
    assert nbytes % 4 == 0
    return torch.zeros(nbytes // 4, dtype=torch.float32)


async def test_basic_operations_store_objects_as_they_are() -> None:
    cache = ByteLRUCache(1000)
    value = {"pixel_values": tensor(400), "grid": (1, 2, 3)}
    assert await cache.set("k", value) is True
    assert await cache.get("k") is value
    assert await cache.exists("k") is True
    assert await cache.get("missing") is None
    assert await cache.get("missing", default="d") == "d"
    assert await cache.delete("k") == 1
    assert await cache.delete("k") == 0
    assert await cache.exists("k") is False
    await cache.set("a", tensor(100))
    await cache.set("b", tensor(100))
    assert await cache.clear() is True
    assert cache.statistics().entries == 0
    assert cache.statistics().bytes == 0


async def test_get_refreshes_recency_and_peek_does_not() -> None:
    cache = ByteLRUCache(300)
    for key in "abc":
        await cache.set(key, tensor(100))
    assert await cache.get("a") is not None  # a is now the most recent; b the least
    await cache.set("d", tensor(100))
    assert [await cache.exists(k) for k in "abcd"] == [True, False, True, True]

    assert cache.peek("c") is not None  # does not save c
    await cache.set("e", tensor(100))
    assert [await cache.exists(k) for k in "acde"] == [True, False, True, True]

    assert cache.peek("a", refresh=True) is not None  # saves a (a read on a peer's behalf)
    assert cache.peek("zz", refresh=True) is None
    await cache.set("f", tensor(100))
    assert [await cache.exists(k) for k in "adef"] == [True, False, True, True]


async def test_eviction_is_by_bytes_with_exact_accounting() -> None:
    cache = ByteLRUCache(1024)
    sizes = {"a": 256, "b": 128, "c": 512, "d": 64}
    for key, size in sizes.items():
        await cache.set(key, tensor(size))
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.evictions) == (4, 960, 0)

    # 960 + 400 > 1024: a (256) goes, 704 + 400 still > 1024: b (128) goes too.
    await cache.set("e", tensor(400))
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, 512 + 64 + 400, 2)
    assert [await cache.exists(k) for k in "abcde"] == [False, False, True, True, True]

    # Replacing a key releases its old size first.
    await cache.set("c", tensor(16))
    assert cache.statistics().bytes == 16 + 64 + 400
    assert cache.statistics().evictions == 2


async def test_oversize_value_is_not_stored_and_counted() -> None:
    cache = ByteLRUCache(1024)
    await cache.set("small", tensor(512))
    await cache.set("big", tensor(64))
    assert await cache.set("big", tensor(1028)) is False
    assert await cache.get("big") is None  # the old value must not be served as the new one
    assert await cache.get("small") is not None
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.oversize_skips, stats.evictions) == (1, 512, 1, 0)
    # Exactly the capacity fits.
    assert await cache.set("full", tensor(1024)) is True
    assert cache.statistics().bytes == 1024


async def test_statistics_count_hits_and_misses() -> None:
    cache = ByteLRUCache(100)
    await cache.set("a", tensor(40))
    await cache.get("a")
    await cache.get("a")
    await cache.get("b")
    assert await cache.multi_get(["a", "b", "c"]) == [cache.peek("a"), None, None]
    assert cache.statistics() == CacheStatistics(
        entries=1, bytes=40, capacity_bytes=100, hits=3, misses=3, evictions=0, oversize_skips=0
    )


async def test_add_increment_and_multi_set_follow_aiocache() -> None:
    cache = ByteLRUCache(100, namespace="ns:")
    await cache.add("a", tensor(8))
    with pytest.raises(ValueError, match="already exists"):
        await cache.add("a", tensor(8))
    assert await cache.increment("n") == 1
    assert await cache.increment("n", 4) == 5
    await cache.multi_set([("x", tensor(4)), ("y", tensor(4))])
    assert cache.peek("x") is not None
    assert await cache.exists("x", namespace="ns:") is True
    assert cache.statistics().bytes == 16


async def test_ttl_expires_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(aiomm.cache._lru, "_now", lambda: now[0])
    cache = ByteLRUCache(100)
    await cache.set("short", tensor(40), ttl=5)
    await cache.set("forever", tensor(40))
    now[0] = 104.0
    assert await cache.get("short") is not None
    now[0] = 106.0
    assert cache.peek("short") is None
    assert await cache.exists("short") is False
    assert await cache.get("forever") is not None
    assert cache.statistics().bytes == 40


@dataclass
class _Item:
    pixels: np.ndarray
    meta: dict[str, object]


class _Sized:
    def nbytes(self) -> int:
        return 7


def test_nbytes_of_walks_containers() -> None:
    t = tensor(64)
    arr = np.zeros((3, 5), dtype=np.float64)
    item = _Item(pixels=arr, meta={"t": [t, (t, b"abcd")], "name": "x", "n": 3})
    assert nbytes_of(t) == 64
    assert nbytes_of(item) == 120 + 64 + 4  # t is reached twice but counted once
    assert nbytes_of([_Sized(), {"k": _Sized()}]) == 14
    assert nbytes_of("a string") == 0


def test_custom_sizeof_and_bad_capacity() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        ByteLRUCache(-1)

    async def main() -> None:
        cache = ByteLRUCache(10, sizeof=len)
        await cache.set("a", "12345")
        await cache.set("b", "123456")
        assert cache.peek("a") is None and cache.peek("b") == "123456"

    anyio.run(main)


_KEYS = st.sampled_from("abcdefgh")
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), _KEYS, st.integers(0, 160)),
        st.tuples(st.just("get"), _KEYS, st.just(0)),
        st.tuples(st.just("delete"), _KEYS, st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 300), ops=_OPS)
def test_matches_an_ordered_dict_model(capacity: int, ops: list[tuple[str, str, int]]) -> None:
    async def main() -> None:
        cache = ByteLRUCache(capacity)
        model: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        evictions = oversize = 0
        for op, key, size in ops:
            if op == "set":
                stored = await cache.set(key, np.zeros(size, dtype=np.uint8))
                model.pop(key, None)
                if size > capacity:
                    oversize += 1
                    assert stored is False
                    continue
                while sum(model.values()) + size > capacity:
                    model.popitem(last=False)
                    evictions += 1
                model[key] = size
            elif op == "get":
                found = await cache.get(key)
                assert (found is not None) == (key in model)
                if key in model:
                    assert found.nbytes == model[key]
                    model.move_to_end(key)
            else:
                assert await cache.delete(key) == int(model.pop(key, None) is not None)

            stats = cache.statistics()
            assert stats.bytes <= capacity
            assert stats.bytes == sum(model.values())
            assert stats.entries == len(model)
        remaining = {k for k in "abcdefgh" if cache.peek(k) is not None}
        assert remaining == set(model)
        stats = cache.statistics()
        assert (stats.evictions, stats.oversize_skips) == (evictions, oversize)

    anyio.run(main)
