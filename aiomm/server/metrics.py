"""Prometheus metrics of one server process (its own registry, so several apps can coexist)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from aiomm.cache.peer import PeerCacheStatistics
from aiomm.engine import PLAN_SOURCES
from aiomm.processing.image_ops import scratch_bytes

__all__ = ("ServerMetrics",)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Request, stage, cache, byte and error metrics; engine queues are read at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "aiomm_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "aiomm_request_seconds",
            "Request latency by endpoint",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "aiomm_stage_seconds",
            "Per-request time in each engine stage",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.images = Counter("aiomm_images", "Images rendered", registry=r)
        self.cache = Counter("aiomm_cache_items", "Item cache outcomes", ["outcome"], registry=r)
        self.plans = Counter(
            "aiomm_plans",
            "Items of routing plans served (mm_payload none), by how each was made: header, "
            "decoded, processed, cached",
            ["source"],
            registry=r,
        )
        for source in PLAN_SOURCES:
            self.plans.labels(source)
        self._plans_seen: dict[str, int] = {}
        self._stage_children: dict[str, Any] = {}
        self.saturation = Gauge(
            "aiomm_saturation",
            "How close this process is to its capacity, 0 to 1 (event_loop, transform_threads: "
            "busy share since the previous scrape; requests: admitted and waiting over the "
            "limit, now; any: the largest)",
            ["resource"],
            registry=r,
        )
        #: (wall clock, the loop thread's CPU, the transform threads' busy seconds) at the
        #: previous scrape: saturation is averaged between scrapes
        self._last_scrape = (time.perf_counter(), time.thread_time(), 0.0)
        self.bytes_in = Counter("aiomm_bytes_in", "Request body bytes", registry=r)
        self.bytes_out = Counter("aiomm_bytes_out", "Response body bytes", registry=r)
        self.errors = Counter("aiomm_errors", "Errors by type", ["type"], registry=r)
        self.queue = Gauge(
            "aiomm_queue_in_use", "Slots in use per engine queue", ["queue"], registry=r
        )
        self.capacity = Gauge(
            "aiomm_queue_capacity", "Slots per engine queue", ["queue"], registry=r
        )
        self.limit = Gauge(
            "aiomm_queue_limit",
            "Slots per engine queue that may be in use now (the transform queue's threads are "
            "held back to --busy-transform-threads while two or more requests are in flight)",
            ["queue"],
            registry=r,
        )
        self.waiting = Gauge(
            "aiomm_queue_waiting", "Tasks waiting per engine queue", ["queue"], registry=r
        )
        self.cache_total = Gauge(
            "aiomm_cache_events_total_engine",
            "Engine cache hits, misses, joins, evictions and items too large for it since start",
            ["event"],
            registry=r,
        )
        self.cache_bytes = Gauge("aiomm_cache_bytes", "Bytes of items the cache holds", registry=r)
        self.cache_capacity = Gauge(
            "aiomm_cache_capacity_bytes", "Bytes of items the cache may hold", registry=r
        )
        self.scratch = Gauge(
            "aiomm_scratch_bytes",
            "Bytes the transform threads keep in their resize and patch scratch buffers",
            registry=r,
        )
        self.cache_pretouched = Gauge(
            "aiomm_cache_pretouched_bytes",
            "Bytes of memory faulted in for the cache before serving (--cache-pretouch)",
            registry=r,
        )
        self.shared_cache = Gauge(
            "aiomm_shared_cache_events_total_engine",
            "Shared (Redis) cache tier: hits, misses, remote joins, bytes, errors, lease waits",
            ["event"],
            registry=r,
        )
        self.shared_cache_up = Gauge(
            "aiomm_shared_cache_available", "1 while the Redis tier is in use", registry=r
        )
        self.peer_cache = Gauge(
            "aiomm_peer_cache_events_total_engine",
            "Worker tier (--workers N): items read from peers, misses, errors, items served, "
            "bytes, links held",
            ["event"],
            registry=r,
        )

    def observe_timings(self, timings: dict[str, float]) -> None:
        children = self._stage_children
        for stage, seconds in timings.items():
            child = children.get(stage)
            if child is None:  # labels() takes a lock and builds its key: once a stage
                child = children[stage] = self.stage.labels(stage)
            child.observe(seconds)

    def _set_saturation(self, engine_stats: Any | None, queues: Mapping[str, Any]) -> None:
        """``aiomm_saturation``: called on the event loop's thread (``thread_time`` is its
        CPU), once a scrape."""
        wall, loop_cpu, busy = time.perf_counter(), time.thread_time(), 0.0
        last_wall, last_loop_cpu, last_busy = self._last_scrape
        span = max(wall - last_wall, 1e-9)
        shares = {"event_loop": min((loop_cpu - last_loop_cpu) / span, 1.0)}
        transform = queues.get("transform")
        if engine_stats is not None and transform is not None:
            busy = float(getattr(engine_stats, "transform_busy_seconds", 0.0))
            threads = max(int(transform.limit), 1)
            shares["transform_threads"] = min(max(busy - last_busy, 0.0) / (span * threads), 1.0)
        requests = queues.get("requests")
        if requests is not None and requests.capacity:
            shares["requests"] = (requests.in_use + requests.waiting) / requests.capacity
        self._last_scrape = (wall, loop_cpu, busy)
        for resource, share in shares.items():
            self.saturation.labels(resource).set(round(share, 4))
        self.saturation.labels("any").set(round(max(shares.values()), 4))

    def render(self, engine_stats: Any | None, pools: Mapping[str, Any] | None = None) -> bytes:
        """The exposition text, with the engine's queues and cache refreshed; ``pools``: the
        server's own worker pools by queue name (``WorkerPoolStatistics``)."""
        queues = {**(pools or {}), **(engine_stats.queues if engine_stats is not None else {})}
        for name, q in queues.items():
            self.queue.labels(name).set(q.in_use)
            self.waiting.labels(name).set(q.waiting)
            self.capacity.labels(name).set(q.capacity)
            self.limit.labels(name).set(q.limit)
        self._set_saturation(engine_stats, queues)
        if engine_stats is not None:
            for source, value in getattr(engine_stats, "plans", {}).items():
                # the engine counts from its start: the counter takes what was added since
                seen = self._plans_seen.get(source, 0)
                if value > seen:
                    self.plans.labels(source).inc(value - seen)
                    self._plans_seen[source] = value
            cache = engine_stats.cache
            for event in ("hits", "misses", "joins", "evictions", "oversize_skips"):
                value = getattr(cache, event, None)
                if isinstance(value, int):
                    self.cache_total.labels(event).set(value)
            for gauge, attr in (
                (self.cache_bytes, "bytes"),
                (self.cache_capacity, "capacity_bytes"),
            ):
                value = getattr(cache, attr, None)
                if isinstance(value, int):
                    gauge.set(value)
            shared = getattr(cache, "shared", None)
            if isinstance(shared, PeerCacheStatistics):
                for event, value in vars(shared).items():
                    self.peer_cache.labels(event).set(value)
            elif shared is not None:
                self.shared_cache_up.set(1 if shared.available else 0)
                for event, value in vars(shared).items():
                    if isinstance(value, int) and not isinstance(value, bool):
                        self.shared_cache.labels(event).set(value)
        self.scratch.set(scratch_bytes())
        return generate_latest(self.registry)
