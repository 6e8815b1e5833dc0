"""The second cache tier: processed items in Redis, shared by every replica, with single flight
across replicas.

Items are stored with :mod:`aiomm.cache.codec` through aiocache's Redis backend (the ``redis``
client, hiredis parser). Keys are ``aiomm:<version>:f<format>:item:<key>``, where ``key`` is the
engine's item key (content hash, adapter fingerprint, processor kwargs, normalise mode): replicas
of other models or other aiomm versions never read each other's items.

Single flight across replicas: the replica that misses takes a lease (``SET lease NX PX``),
computes, writes the item and drops the lease; a replica that finds the lease taken polls for the
item with a doubling delay (``poll_min_s`` .. ``poll_max_s``). A lease expires on its own
(``lease_ttl_s``, renewed while its holder computes), so a replica that dies mid-compute blocks
nobody for longer; a holder that cannot store its item (too large, failed) leaves a short-lived
"compute it yourself" marker instead, so nobody waits for a value that will not come.

Faults: every Redis command is bounded by ``op_timeout_s``. The first error marks the tier down:
for ``retry_after_s`` it is bypassed (items are computed locally, as without Redis), then the next
request tries again; the redis client reconnects by itself. Each change is logged once
(``shared_cache_unavailable`` / ``shared_cache_recovered``) and counted in
:class:`SharedCacheStatistics`.

Runs on the event loop of an asyncio-backed anyio (aiocache is asyncio-only). Thread safety: none.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from aiocache import RedisCache
from aiocache.serializers import NullSerializer
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from aiomm import __version__
from aiomm.cache.codec import FORMAT_VERSION, decode_item, encode_item
from aiomm.config import SharedCacheConfig
from aiomm.errors import CacheValueError
from aiomm.logging import get_logger
from aiomm.processing.fields import MultiModalKwargsItem

__all__ = ("SharedCacheStatistics", "SharedItemCache", "SharedOutcome")

log = get_logger(__name__)

#: how the shared tier obtained an item: read at once, landed while waiting for another
#: replica's lease, or computed here (holding the lease, or without the tier)
SharedOutcome = Literal["hit", "joined", "computed"]

# Left in the lease key by a holder that could not store its item: waiters compute themselves.
_LOCAL = b"!local"
_RELEASE = (
    "if redis.call('get',KEYS[1]) == ARGV[1] then return redis.call('del',KEYS[1]) end return 0"
)
_RENEW = (
    "if redis.call('get',KEYS[1]) == ARGV[1] then return redis.call('pexpire',KEYS[1],ARGV[2]) "
    "end return 0"
)
_MARK_LOCAL = (
    "if redis.call('get',KEYS[1]) == ARGV[1] then "
    "return redis.call('set',KEYS[1],ARGV[2],'PX',ARGV[3]) end return 0"
)
_ERRORS = (RedisError, OSError, asyncio.TimeoutError, TimeoutError)


class _Unavailable(Exception):
    """A Redis command failed or the tier is bypassed: compute locally."""


@dataclass(frozen=True)
class SharedCacheStatistics:
    """A snapshot of a :class:`SharedItemCache`."""

    #: False while the tier is bypassed after an error
    available: bool
    #: items read from Redis at the first look
    hits: int
    #: items computed here while holding the lease, then written (or offered) to Redis
    misses: int
    #: items another replica computed while this one waited on its lease (remote joins)
    joins: int
    #: items computed without the tier: it was down, a lease wait timed out, or the holder
    #: could not store the item
    local_computes: int
    stored: int
    bytes_read: int
    bytes_written: int
    #: Redis commands that failed or timed out
    errors: int
    #: stored values that could not be decoded (read as misses and deleted)
    corrupt: int
    #: items larger than ``max_item_bytes`` (kept in the local tier only)
    oversize_skips: int
    #: items the format cannot hold (kept in the local tier only)
    unstorable: int
    #: times this replica waited on another replica's lease
    lease_waits: int
    #: waits that gave up after ``lease_wait_s`` and computed locally
    lease_wait_timeouts: int
    #: leases taken over after their holder vanished without a value (expired or dropped)
    lease_takeovers: int
    #: requests that skipped the tier while it was down
    bypassed: int
    #: times the tier came back after being down
    recoveries: int
    last_error: str | None


class SharedItemCache:
    """Items in Redis with cross-replica single flight; see the module docstring.

    :param url: ``redis://[:password@]host[:port][/db]``.
    :param config: bounds, timeouts and lease settings.
    :param namespace: the prefix of every key (default: aiomm's version and the format version).
    """

    def __init__(
        self, url: str, config: SharedCacheConfig, *, namespace: str | None = None
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        self.config = config
        self.url = url
        self.namespace = namespace or f"aiomm:{__version__}:f{FORMAT_VERSION}"
        self._cache = RedisCache(
            serializer=NullSerializer(encoding=None),
            namespace=self.namespace,
            endpoint=parts.hostname or "127.0.0.1",
            port=parts.port or 6379,
            db=int(parts.path.lstrip("/") or 0),
            password=parts.password,
            timeout=config.op_timeout_s,
            create_connection_timeout=config.connect_timeout_s,
            # Fail fast and let the tier's own retry_after_s decide when to try again.
            connection_pool_kwargs={
                "socket_timeout": config.op_timeout_s,
                "retry": Retry(NoBackoff(), 0),
            },
        )
        self._down_until: float | None = None
        self._last_error: str | None = None
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "joins",
                "local_computes",
                "stored",
                "bytes_read",
                "bytes_written",
                "errors",
                "corrupt",
                "oversize_skips",
                "unstorable",
                "lease_waits",
                "lease_wait_timeouts",
                "lease_takeovers",
                "bypassed",
                "recoveries",
            ),
            0,
        )

    @property
    def cache(self) -> RedisCache:
        """The aiocache Redis backend."""
        return self._cache

    def item_key(self, key: str) -> str:
        """The Redis key of an item key (namespace included)."""
        return self._cache.build_key(f"item:{key}")

    def lease_key(self, key: str) -> str:
        """The Redis key of an item's lease (namespace included)."""
        return self._cache.build_key(f"lease:{key}")

    async def probe(self) -> bool:
        """Ping Redis (bounded by ``op_timeout_s``); log and return whether it answered."""
        try:
            await self._op(self._cache.raw("ping"))
        except _Unavailable:
            return False
        log.info("shared_cache_ready", url=_redacted(self.url), namespace=self.namespace)
        return True

    async def aclose(self) -> None:
        """Close the connections (aiocache's ``close`` uses a deprecated redis call)."""
        await self._cache.client.aclose()

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[MultiModalKwargsItem]]
    ) -> tuple[MultiModalKwargsItem, SharedOutcome]:
        """The item of ``key`` from Redis, from another replica's computation, or from
        ``compute`` (written to Redis when it fits).

        Redis errors never reach the caller: the item is computed locally instead.

        :raises: whatever ``compute`` raised.
        """
        token = uuid.uuid4().hex
        try:
            found, item = await self._find_or_lease(key, token)
        except _Unavailable:
            found, item = "local", None
        if item is not None:
            return item, "hit" if found == "hit" else "joined"
        if found == "local":
            self._counts["local_computes"] += 1
            return await compute(), "computed"
        self._counts["misses"] += 1
        return await self._compute_holding(key, token, compute), "computed"

    async def start(self, lookup: Callable[[str], Any]) -> None:
        """Nothing to start: Redis serves the other replicas itself."""

    def store_hit(self, key: str) -> bool:
        """Always: an item read from Redis is kept in the process too (the next read of it
        would cross the network)."""
        return True

    def statistics(self) -> SharedCacheStatistics:
        """Return a snapshot of the counters."""
        return SharedCacheStatistics(
            available=self._down_until is None, last_error=self._last_error, **self._counts
        )

    # -- lookup and lease ----------------------------------------------------------------------

    async def _find_or_lease(
        self, key: str, token: str
    ) -> tuple[Literal["hit", "joined", "lease", "local"], MultiModalKwargsItem | None]:
        """``("hit" | "joined", item)``, ``("lease", None)`` when this replica now holds the
        lease, or ``("local", None)`` to compute without the tier.

        :raises _Unavailable: a Redis command failed.
        """
        if self._down_until is not None and time.monotonic() < self._down_until:
            self._counts["bypassed"] += 1
            return "local", None
        cfg = self.config
        item_key, lease_key = f"item:{key}", f"lease:{key}"
        value = await self._op(self._cache.get(item_key))
        item = self._decode(key, value)
        if item is not None:
            self._counts["hits"] += 1
            return "hit", item
        if value is not None:
            await self._op(self._cache.delete(item_key))  # corrupt: make room for a good one
        deadline = time.monotonic() + cfg.lease_wait_s
        delay = cfg.poll_min_s
        waited = False
        while True:
            if await self._acquire(lease_key, token):
                # The previous holder may have stored the item and left between our read and
                # our lease: read once more before computing it again.
                item = self._decode(key, await self._op(self._cache.get(item_key)))
                if item is not None:
                    await self._op(self._cache.raw("eval", _RELEASE, 1, self.lease_key(key), token))
                    self._counts["hits" if not waited else "joins"] += 1
                    return "hit" if not waited else "joined", item
                if waited:
                    self._counts["lease_takeovers"] += 1
                return "lease", None
            if not waited:
                self._counts["lease_waits"] += 1
                waited = True
            value, lease = await self._op(self._cache.multi_get([item_key, lease_key]))
            item = self._decode(key, value)
            if item is not None:
                self._counts["joins"] += 1
                return "joined", item
            if lease == _LOCAL:
                return "local", None
            if lease is None:
                continue  # the holder is gone without a value: take the lease
            if time.monotonic() >= deadline:
                self._counts["lease_wait_timeouts"] += 1
                log.warning("shared_cache_lease_wait_timeout", key=key, waited_s=cfg.lease_wait_s)
                return "local", None
            await anyio.sleep(delay)
            delay = min(delay * 2, cfg.poll_max_s)

    async def _acquire(self, lease_key: str, token: str) -> bool:
        try:
            # SET NX PX: aiocache's add sends a float ttl as milliseconds.
            await self._op(self._cache.add(lease_key, token, ttl=float(self.config.lease_ttl_s)))
        except ValueError:  # aiocache: the key exists
            return False
        return True

    async def _compute_holding(
        self, key: str, token: str, compute: Callable[[], Awaitable[MultiModalKwargsItem]]
    ) -> MultiModalKwargsItem:
        lease_key = self.lease_key(key)
        stored = finished = False
        try:
            error: Exception | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._renew, lease_key, token)
                try:
                    item = await compute()
                except Exception as exc:
                    # Raised after the renewal stops, so it does not arrive in an exception group.
                    error = exc
                tg.cancel_scope.cancel()
            finished = True
            if error is not None:
                raise error
            stored = await self._write(key, item)
            return item
        finally:
            cancelled = anyio.get_cancelled_exc_class()
            # Shielded and bounded: an engine closing mid-compute still hands the lease on.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.op_timeout_s):
                try:
                    if stored or not finished:
                        # cancelled holders drop the lease: the next replica takes it at once
                        await self._cache.raw("eval", _RELEASE, 1, lease_key, token)
                    else:
                        # Nobody should wait for a value that will not come: mark the key
                        # "compute it yourself" for a lease period.
                        await self._cache.raw(
                            "eval",
                            _MARK_LOCAL,
                            1,
                            lease_key,
                            token,
                            _LOCAL,
                            int(self.config.lease_ttl_s * 1000),
                        )
                except (*_ERRORS, cancelled) as exc:
                    log.debug("shared_cache_release_failed", key=key, error=repr(exc))

    async def _renew(self, lease_key: str, token: str) -> None:
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        while True:
            await anyio.sleep(self.config.lease_ttl_s / 3)
            try:
                await self._cache.raw("eval", _RENEW, 1, lease_key, token, ttl_ms)
            except _ERRORS as exc:
                log.debug("shared_cache_renew_failed", error=repr(exc))

    # -- values --------------------------------------------------------------------------------

    def _decode(self, key: str, value: bytes | None) -> MultiModalKwargsItem | None:
        if value is None:
            return None
        self._counts["bytes_read"] += len(value)
        try:
            return decode_item(value)
        except CacheValueError as exc:
            self._counts["corrupt"] += 1
            log.warning("shared_cache_corrupt_value", key=key, bytes=len(value), error=str(exc))
            return None

    async def _write(self, key: str, item: MultiModalKwargsItem) -> bool:
        try:
            blob = encode_item(item)
        except CacheValueError as exc:
            self._counts["unstorable"] += 1
            log.debug("shared_cache_unstorable", key=key, error=str(exc))
            return False
        if len(blob) > self.config.max_item_bytes:
            self._counts["oversize_skips"] += 1
            return False
        ttl = self.config.ttl_s
        try:
            await self._op(
                self._cache.set(f"item:{key}", blob, ttl=None if ttl is None else float(ttl))
            )
        except _Unavailable:
            return False
        self._counts["stored"] += 1
        self._counts["bytes_written"] += len(blob)
        return True

    # -- health --------------------------------------------------------------------------------

    async def _op(self, operation: Awaitable[Any]) -> Any:
        """Await one Redis command, turning its failure into :class:`_Unavailable`."""
        try:
            result = await operation
        except _ERRORS as exc:
            self._counts["errors"] += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            if self._down_until is None:
                log.warning(
                    "shared_cache_unavailable",
                    url=_redacted(self.url),
                    error=self._last_error,
                    retry_after_s=self.config.retry_after_s,
                )
            self._down_until = time.monotonic() + self.config.retry_after_s
            raise _Unavailable from exc
        if self._down_until is not None:
            self._down_until = None
            self._counts["recoveries"] += 1
            log.info("shared_cache_recovered", url=_redacted(self.url))
        return result


def _redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f":***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
