"""The cache stage: per-item lookup in the item cache, and single flight for misses.

Input: a content hash (or a client-supplied one) and the request's processor kwargs. Output: the
item, from the cache or from the computation given (started once per key however many requests
ask at once); for a routing plan, the plan made earlier for the same key. With
``shared_cache_url`` the computation first asks the Redis tier shared by every replica
(:mod:`aiomm.cache.redis`). Runs on the event loop; computations run in the engine's task group."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiomm.cache.item_cache import CacheOutcome, ItemCache, ItemCacheStatistics
from aiomm.media.hashing import item_cache_key
from aiomm.processing.fields import MultiModalKwargsItem

from ._stage import Stage

__all__ = ("PLANS_KEPT", "CacheStage")

#: routing plans kept by the cache stage (:meth:`CacheStage.plan_lookup`)
PLANS_KEPT = 65536


class CacheStage(Stage):
    """Keys items by content, adapter and kwargs; looks them up or computes them once.

    With ``enabled=False`` (no local capacity and no shared tier) every item is computed,
    uncached. With ``trust_supplied_hashes=False`` the pipeline ignores client-supplied hashes.
    """

    name = "cache"

    def __init__(
        self,
        cache: ItemCache,
        *,
        fingerprint: str,
        normalize_mode: str,
        enabled: bool,
        trust_supplied_hashes: bool = True,
    ) -> None:
        super().__init__(None)
        self.cache = cache
        self.enabled = enabled
        self.trust_supplied_hashes = trust_supplied_hashes
        self._fingerprint = fingerprint
        self._normalize_mode = normalize_mode
        self._plans: OrderedDict[str, MultiModalKwargsItem] = OrderedDict()

    def key(
        self,
        content_hash: str,
        kwargs: Mapping[str, Any],
        *,
        supplied: bool = False,
        tenant: str | None = None,
    ) -> str:
        """The cache key of an item.

        A supplied hash is chosen by the client, so it lives in a namespace of its own, per
        ``tenant``: it can neither equal a content hash's key (those are hex digests, the
        namespace a JSON list) nor another tenant's. Content hashes are verified, so their
        entries are shared by every tenant.
        """
        if supplied:
            content_hash = json.dumps(["supplied", tenant or "", content_hash])
        return item_cache_key(
            content_hash,
            adapter=self._fingerprint,
            processor_kwargs=kwargs,
            normalize_mode=self._normalize_mode,
        )

    def plan_lookup(self, key: str) -> MultiModalKwargsItem | None:
        """The routing plan of ``key`` made earlier, or None (a few dozen bytes an entry, kept
        apart from the items, the most recent :data:`PLANS_KEPT`)."""
        if not self.enabled:
            return None
        item = self._plans.get(key)
        if item is not None:
            self._plans.move_to_end(key)
        return item

    def plan_store(self, key: str, item: MultiModalKwargsItem) -> None:
        """Keep the routing plan of ``key`` (:meth:`plan_lookup`)."""
        if not self.enabled:
            return
        self._plans[key] = item
        self._plans.move_to_end(key)
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)

    def lookup(self, key: str) -> MultiModalKwargsItem | None:
        """The cached item of ``key`` now, counted as a hit, or None (not counted: the
        caller goes on to :meth:`get_or_compute`)."""
        if not self.enabled:
            return None
        return self.cache.lookup(key)

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[MultiModalKwargsItem]]
    ) -> tuple[MultiModalKwargsItem, CacheOutcome]:
        """The item of ``key`` and how it was obtained.

        :raises: whatever ``compute`` raised (failures are not cached).
        """
        with self.counted():
            if not self.enabled:
                return await compute(), CacheOutcome.UNCACHED
            return await self.cache.get_or_compute(key, compute)

    def cache_statistics(self) -> ItemCacheStatistics:
        return self.cache.statistics()
