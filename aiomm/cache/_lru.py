"""A byte-bounded LRU cache with aiocache's interface.

:class:`ByteLRUCache` stores Python objects as they are (no serializer) and bounds them by their
size in bytes, measured by a ``sizeof`` callable (default :func:`nbytes_of`). Its async methods
are those of an ``aiocache`` backend (``get``, ``set``, ``add``, ``exists``, ``delete``, ...), so
any aiocache backend can take its place in :class:`~aiomm.cache.item_cache.ItemCache`, without
the engine depending on aiocache itself.

Thread safety: none. Every method must be called from the event-loop thread; no method suspends,
so each operation is atomic with respect to other tasks on that loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiomm.logging import get_logger

__all__ = ("DEFAULT_CAPACITY_BYTES", "ByteLRUCache", "CacheStatistics", "nbytes_of")

logger = get_logger(__name__)

#: 4 GiB, vLLM's default per-process multimodal cache size.
DEFAULT_CAPACITY_BYTES = 4 * 1024**3


def nbytes_of(value: Any) -> int:
    """Return the bytes held by the tensors and arrays in ``value``; the default ``sizeof``.

    An object with an ``nbytes`` attribute (torch tensors, numpy arrays, memoryviews) or an
    ``nbytes()`` method counts as that many bytes; ``bytes``/``bytearray`` as their length; dicts,
    lists, tuples, sets and dataclass instances as the sum of their members. Anything else counts
    as 0. An object reached twice is counted once; views count their own ``nbytes`` even when
    they share storage with another tensor.
    """
    seen: set[int] = set()

    def visit(obj: Any) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        nbytes = getattr(obj, "nbytes", None)
        if nbytes is not None:
            return int(nbytes() if callable(nbytes) else nbytes)
        if isinstance(obj, (bytes, bytearray)):
            return len(obj)
        if isinstance(obj, (str, int, float)):
            return 0
        if isinstance(obj, dict):
            return sum(visit(v) for v in obj.values())
        if isinstance(obj, (list, tuple, set, frozenset)):
            return sum(visit(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return sum(visit(getattr(obj, f.name)) for f in dataclasses.fields(obj))
        return 0

    return visit(value)


@dataclass(frozen=True)
class CacheStatistics:
    """A snapshot of a :class:`ByteLRUCache`."""

    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    #: entries dropped to make room for new ones (not deletes, clears or TTL expiries)
    evictions: int
    #: values not stored because they alone exceed ``capacity_bytes``
    oversize_skips: int


@dataclass
class _Entry:
    value: Any
    size: int
    expires_at: float | None  # time.monotonic() deadline, None for no TTL


class ByteLRUCache:
    """An in-process cache bounded in bytes that evicts the least recently used entries.

    ``set`` returns ``False`` (and stores nothing, dropping any previous value of the key) when the
    value alone is larger than ``capacity_bytes``; the caller then serves it uncached. ``get``
    refreshes an entry's recency, :meth:`peek` does not. A value of ``None`` reads as a miss, as
    in every aiocache backend.

    TTLs are optional and lazy: an expired entry is dropped when it is next read, or evicted in
    LRU order like any other. No operation suspends or blocks.

    :param capacity_bytes: the byte budget, default 4 GiB.
    :param sizeof: measures a value in bytes, default :func:`nbytes_of`.
    :param namespace: prefixed to every key, as in aiocache.
    :raises ValueError: if ``capacity_bytes`` is negative.
    """

    NAME = "byte_lru"

    def __init__(
        self,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        *,
        sizeof: Callable[[Any], int] = nbytes_of,
        namespace: str = "",
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{capacity_bytes=} should be a non-negative number of bytes")
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self._sizeof = sizeof
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._oversize_skips = 0

    # -- aiocache's interface ------------------------------------------------------------------

    def build_key(self, key: str, namespace: str | None = None) -> str:
        """``key`` with ``namespace`` (default: the cache's) in front."""
        return f"{self.namespace if namespace is None else namespace}{key}"

    async def get(self, key: str, default: Any = None, namespace: str | None = None) -> Any:
        """Return the value of ``key`` (now the most recently used), or ``default``."""
        value = self._lookup(self.build_key(key, namespace))
        return default if value is None else value

    async def multi_get(self, keys: Iterable[str], namespace: str | None = None) -> list[Any]:
        """Return the values of ``keys`` (``None`` for each missing one)."""
        return [self._lookup(self.build_key(key, namespace)) for key in keys]

    async def set(
        self, key: str, value: Any, ttl: float | None = None, namespace: str | None = None
    ) -> bool:
        """Store ``value`` under ``key``; ``False`` when it alone exceeds the capacity."""
        return self._store(self.build_key(key, namespace), value, ttl)

    async def multi_set(
        self,
        pairs: Iterable[tuple[str, Any]],
        ttl: float | None = None,
        namespace: str | None = None,
    ) -> bool:
        """Store each ``(key, value)`` pair."""
        for key, value in pairs:
            self._store(self.build_key(key, namespace), value, ttl)
        return True

    async def add(
        self, key: str, value: Any, ttl: float | None = None, namespace: str | None = None
    ) -> bool:
        """Store ``value`` under ``key`` only if it is absent.

        :raises ValueError: ``key`` exists (as aiocache's backends raise).
        """
        built = self.build_key(key, namespace)
        if self._live(built) is not None:
            raise ValueError(f"Key {built} already exists, use .set to update the value")
        return self._store(built, value, ttl)

    async def exists(self, key: str, namespace: str | None = None) -> bool:
        """Whether ``key`` holds a live value (its recency unchanged)."""
        return self._live(self.build_key(key, namespace)) is not None

    async def increment(self, key: str, delta: int = 1, namespace: str | None = None) -> int:
        """Add ``delta`` to the integer under ``key`` (0 when absent) and return it.

        :raises TypeError: the value is not an integer.
        """
        built = self.build_key(key, namespace)
        entry = self._live(built)
        if entry is None:
            self._store(built, delta, None)
            return delta
        try:
            value = int(entry.value) + delta
        except (TypeError, ValueError):
            raise TypeError("Value is not an integer") from None
        entry.value = value
        return value

    async def expire(self, key: str, ttl: float | None, namespace: str | None = None) -> bool:
        """Give ``key`` a new TTL (``None`` or 0: none); ``False`` when it is absent."""
        entry = self._live(self.build_key(key, namespace))
        if entry is None:
            return False
        entry.expires_at = _now() + ttl if ttl else None
        return True

    async def delete(self, key: str, namespace: str | None = None) -> int:
        """Remove ``key``; 1 if it was there, else 0."""
        return int(self._remove(self.build_key(key, namespace)))

    async def clear(self, namespace: str | None = None) -> bool:
        """Remove every entry, or only those whose key starts with ``namespace``."""
        if namespace:
            for key in [k for k in self._entries if k.startswith(namespace)]:
                self._remove(key)
        else:
            self._entries.clear()
            self._bytes = 0
        return True

    async def close(self) -> None:
        """Nothing to release (aiocache's interface)."""

    # -- synchronous helpers -------------------------------------------------------------------

    def peek(self, key: str, namespace: str | None = None, *, refresh: bool = False) -> Any:
        """Return the value of ``key`` or ``None``, without counting a hit; ``refresh`` makes it
        the most recently used (a read on another's behalf, that should keep it)."""
        built = self.build_key(key, namespace=namespace)
        entry = self._live(built)
        if entry is None:
            return None
        if refresh:
            self._entries.move_to_end(built)
        return entry.value

    def statistics(self) -> CacheStatistics:
        """Return a snapshot of the cache's size and counters."""
        return CacheStatistics(
            entries=len(self._entries),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            oversize_skips=self._oversize_skips,
        )

    # -- internals -----------------------------------------------------------------------------

    def _live(self, key: str) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= _now():
            self._remove(key)
            return None
        return entry

    def _remove(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _lookup(self, key: str) -> Any:
        entry = self._live(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        self._entries.move_to_end(key)
        return entry.value

    def _store(self, key: str, value: Any, ttl: float | None) -> bool:
        size = self._sizeof(value)
        if size < 0:
            raise ValueError(f"sizeof returned {size} bytes for key {key!r}")
        # A value that cannot be stored still replaces the old one: reads must never go stale.
        self._remove(key)
        if size > self.capacity_bytes:
            self._oversize_skips += 1
            logger.debug("cache_oversize_skip", size=size, capacity_bytes=self.capacity_bytes)
            return False
        while self._bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
            self._evictions += 1
        expires_at = _now() + ttl if ttl else None
        self._entries[key] = _Entry(value, size, expires_at)
        self._bytes += size
        return True


def _now() -> float:
    return time.monotonic()
