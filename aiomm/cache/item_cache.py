"""The processed-item cache: a cache backend plus single-flight deduplication of misses.

A request first reads the backend; on a miss it joins (or starts) the single computation of that
key, whose result is stored before any caller wakes, unless :meth:`ItemCache.clear` ran meanwhile.
With a second tier (:class:`SecondTier`, e.g. :class:`aiomm.cache.redis.SharedItemCache`) the
computation first asks that tier, which may hold the item or deduplicate it across processes.

Thread safety: none. Use it from the event-loop thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from anyio.abc import TaskGroup

from ._lru import DEFAULT_CAPACITY_BYTES, ByteLRUCache, CacheStatistics
from ._singleflight import SingleFlight

__all__ = ("CacheBackend", "CacheOutcome", "ItemCache", "ItemCacheStatistics", "SecondTier")

T = TypeVar("T")


class CacheBackend(Protocol):
    """What :class:`ItemCache` needs of a backend: a subset of aiocache's interface, so any
    aiocache backend (or :class:`ByteLRUCache`, the default) fits."""

    async def get(self, key: str) -> Any:
        """The value of ``key``, ``None`` when absent."""
        ...

    async def set(self, key: str, value: Any) -> Any:
        """Store ``value``; a falsy result when it was not stored."""
        ...

    async def clear(self) -> Any:
        """Remove every entry."""
        ...


class CacheOutcome(enum.Enum):
    """How :meth:`ItemCache.get_or_compute` obtained a value."""

    #: read from the backend
    HIT = "hit"
    #: computed by the computation this caller started, and stored
    MISS = "miss"
    #: the result of a computation another caller started
    JOINED = "joined"
    #: computed by the computation this caller started, but not stored: the backend refused it
    #: (larger than the whole cache) or :meth:`ItemCache.clear` ran while it was computed
    UNCACHED = "uncached"
    #: read from the second (shared) tier, then stored in the first when the tier's
    #: ``store_hit`` says so
    SHARED_HIT = "shared_hit"
    #: computed by another process while this one waited for it in the second tier
    SHARED_JOINED = "shared_joined"


class SecondTier(Protocol):
    """A cache behind the in-process one, consulted by the single computation of a key."""

    async def start(self, lookup: Callable[[str], Any]) -> None:
        """Called once the first tier exists: ``lookup`` (on the event loop) reads an item it
        holds, and counts as a use of it (a tier that serves other processes from it).

        :raises ConfigError: the tier cannot start.
        """
        ...

    def store_hit(self, key: str) -> bool:
        """Whether the first tier keeps the value of ``key`` just read from this one (else it
        serves that read only, and the next read asks this tier again)."""
        ...

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[Any]]
    ) -> tuple[Any, str]:
        """The value and how it was obtained: ``"hit"``, ``"joined"`` or ``"computed"``.

        :raises: whatever ``compute`` raised; the tier's own failures must not escape.
        """
        ...

    def statistics(self) -> Any:
        """A snapshot of the tier's counters."""
        ...


@dataclass(frozen=True)
class ItemCacheStatistics:
    """A snapshot of an :class:`ItemCache`; byte and entry figures are 0 for foreign backends."""

    hits: int
    misses: int
    joins: int
    uncached: int
    #: items read from the second tier (also counted by it)
    shared_hits: int
    #: items another process computed while this one waited in the second tier
    shared_joins: int
    #: computations that raised (every caller of one got the exception)
    failures: int
    in_flight: int
    entries: int
    bytes: int
    capacity_bytes: int
    evictions: int
    oversize_skips: int
    #: the second tier's statistics (``SharedCacheStatistics`` for Redis), None without one
    shared: Any = None


class ItemCache:
    """Looks items up in a cache backend and computes each missing key once.

    Values must not be ``None``: aiocache reads a stored ``None`` as a miss.

    :param task_group: where computations run (the Engine's); see :class:`SingleFlight`.
    :param backend: any aiocache backend; default ``ByteLRUCache(capacity_bytes)``. Its ``set``
        must return a falsy value when it did not store the value.
    :param capacity_bytes: the byte budget of the default backend.
    :param second_tier: looked up (and filled) by the computation of a key missing here.
    """

    def __init__(
        self,
        task_group: TaskGroup,
        backend: CacheBackend | None = None,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        second_tier: SecondTier | None = None,
    ) -> None:
        self._backend: CacheBackend = (
            backend if backend is not None else ByteLRUCache(capacity_bytes)
        )
        self._second = second_tier
        self._shared_hits = 0
        self._shared_joins = 0
        self._flight = SingleFlight(task_group)
        self._hits = 0
        self._misses = 0
        self._joins = 0
        self._uncached = 0

    @property
    def backend(self) -> CacheBackend:
        """The cache backend."""
        return self._backend

    @property
    def second_tier(self) -> SecondTier | None:
        """The cache behind this one, if any."""
        return self._second

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[T]]
    ) -> tuple[T, CacheOutcome]:
        """Return the value of ``key``, computing and storing it with ``compute`` on a miss.

        Cancelling the caller never cancels a computation other callers wait for; see
        :class:`SingleFlight`.

        :raises: whatever ``compute`` raised (failures are not cached).
        """
        value = await self._backend.get(key)
        if value is not None:
            self._hits += 1
            return value, CacheOutcome.HIT

        # Only the leader's closures run; they report how its value was obtained.
        outcome = CacheOutcome.UNCACHED

        async def compute_once() -> T:
            nonlocal outcome
            # A remote backend suspends in get(): another flight may have stored the key since.
            cached = await self._backend.get(key)
            if cached is not None:
                outcome = CacheOutcome.HIT
                return cached
            if self._second is None:
                return await compute()
            value, how = await self._second.get_or_compute(key, compute)
            if how != "computed":
                outcome = CacheOutcome.SHARED_HIT if how == "hit" else CacheOutcome.SHARED_JOINED
            return value

        async def store(result: T) -> None:
            nonlocal outcome
            if outcome is CacheOutcome.HIT:
                return
            second = self._second
            if (
                outcome is CacheOutcome.SHARED_HIT
                and second is not None
                and not second.store_hit(key)
            ):
                return
            stored = await self._backend.set(key, result)
            if stored and outcome is CacheOutcome.UNCACHED:
                outcome = CacheOutcome.MISS

        value, joined = await self._flight.do(key, compute_once, store=store)
        if joined:
            outcome = CacheOutcome.JOINED
        self._count(outcome)
        return value, outcome

    def lookup(self, key: str) -> Any:
        """The cached value of ``key`` now (counted as a hit), or ``None`` (not counted: the
        caller is expected to go on to :meth:`get_or_compute`, which counts the outcome).

        Backends without a synchronous ``peek`` (remote ones) always answer ``None``.
        """
        value = self.peek(key)
        if value is not None:
            self._hits += 1
        return value

    def peek(self, key: str, *, refresh: bool = False) -> Any:
        """Return the cached value of ``key`` or ``None``, without counting it; ``refresh``
        makes it the most recently used in the default backend (others are only read).

        Backends without a synchronous ``peek`` (remote ones) always answer ``None``.
        """
        if refresh and isinstance(self._backend, ByteLRUCache):
            return self._backend.peek(key, refresh=True)
        peek = getattr(self._backend, "peek", None)
        return None if peek is None else peek(key)

    async def clear(self) -> None:
        """Empty the backend; computations running now will not store their results."""
        self._flight.invalidate()
        await self._backend.clear()

    def statistics(self) -> ItemCacheStatistics:
        """Return a snapshot of the request outcomes, the computations and the backend."""
        flights = self._flight.statistics()
        stats = getattr(self._backend, "statistics", None)
        backend = stats() if stats is not None else None
        if not isinstance(backend, CacheStatistics):
            backend = CacheStatistics(0, 0, 0, 0, 0, 0, 0)
        return ItemCacheStatistics(
            hits=self._hits,
            misses=self._misses,
            joins=self._joins,
            uncached=self._uncached,
            shared_hits=self._shared_hits,
            shared_joins=self._shared_joins,
            failures=flights.failures,
            in_flight=flights.in_flight,
            entries=backend.entries,
            bytes=backend.bytes,
            capacity_bytes=backend.capacity_bytes,
            evictions=backend.evictions,
            oversize_skips=backend.oversize_skips,
            shared=None if self._second is None else self._second.statistics(),
        )

    def _count(self, outcome: CacheOutcome) -> None:
        if outcome is CacheOutcome.HIT:
            self._hits += 1
        elif outcome is CacheOutcome.MISS:
            self._misses += 1
        elif outcome is CacheOutcome.JOINED:
            self._joins += 1
        elif outcome is CacheOutcome.SHARED_HIT:
            self._shared_hits += 1
        elif outcome is CacheOutcome.SHARED_JOINED:
            self._shared_joins += 1
        else:
            self._uncached += 1
