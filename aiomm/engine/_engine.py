"""The Engine: an async context manager that composes the stages and owns their lifecycle.

It builds one object per stage (:mod:`aiomm.engine.stages`), each bounded by an ``EngineConfig``
field, and a :class:`~aiomm.engine._pipeline.Pipeline` that runs a request through them; a stage
that falls behind makes the stages before it wait (backpressure all the way up to ``stream()``'s
source). It owns the task group (single-flight computations and streams run there), the fetcher, the
item cache and the device stage, and aggregates their statistics.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import AsyncIterable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import torch

from aiomm.cache.item_cache import ItemCache, SecondTier
from aiomm.cache.peer import PeerItemCache
from aiomm.config import EngineConfig, Fidelity
from aiomm.device.stage import DeviceStage, DeviceStageStatistics
from aiomm.engine._audio import AudioLoader
from aiomm.engine._byte_budget import ByteBudget, ByteBudgetStatistics
from aiomm.engine._ids import random_hex
from aiomm.engine._pipeline import Pipeline
from aiomm.engine._stats import LatencyStats, StageRecorder
from aiomm.engine._stream import ResultStream
from aiomm.engine.stages import (
    AdmissionStage,
    AssembleStage,
    CacheStage,
    Decoder,
    Fetcher,
    Hasher,
    HashStage,
    LoadStage,
    OutputStage,
    PillowDecoder,
    StageStatistics,
    TransformStage,
    VideoLimits,
    is_network,
)
from aiomm.errors import AiommError, ConfigError, EngineClosedError, ProcessingError
from aiomm.logging import get_logger
from aiomm.media.fetch import MediaFetcher
from aiomm.processing.processor import BaseMultiModalProcessor
from aiomm.tracing import past_span, span, tracing_enabled
from aiomm.tuning import malloc as memory
from aiomm.tuning.malloc import tune_malloc
from aiomm.tuning.pillow import keep_pillow_blocks, pillow_blocks_limit, release_pillow_blocks
from aiomm.types import Request, Result

__all__ = ("Engine", "EngineStats", "LimiterStats")

log = get_logger(__name__)


@dataclass(frozen=True)
class LimiterStats:
    """One bounded queue: its capacity, the slots in use, the tasks waiting for one and the
    slots that may be in use now (``limit``: the capacity unless held back, as the transform
    stage's threads are by ``busy_transform_threads``)."""

    capacity: int
    in_use: int
    waiting: int
    limit: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters, queues, stages and latencies."""

    requests_started: int
    requests_completed: int
    requests_failed: int
    requests_cancelled: int
    #: refused at once with OverloadedError (``EngineConfig.max_waiting``)
    requests_shed: int
    images_processed: int
    videos_processed: int
    bytes_to_device: int
    #: per-request latency of each stage (summed over a request's items)
    stages: dict[str, LatencyStats]
    queues: dict[str, LimiterStats]
    #: each stage's bound, use and outcomes
    stage_statistics: dict[str, StageStatistics]
    decoded_bytes: ByteBudgetStatistics
    cache: Any
    fetch: Any
    device: DeviceStageStatistics
    #: items of routing plans (:meth:`Engine.plan`) by how each was made: ``header``,
    #: ``decoded``, ``processed`` (an adapter that cannot plan), ``cached``
    plans: dict[str, int] = field(default_factory=dict)
    #: seconds the transform threads spent running jobs, summed over threads, since the start
    transform_busy_seconds: float = 0.0
    audios_processed: int = 0


class Engine:
    """Async preprocessing engine for one model adapter.

    Use it as an async context manager: ``async with Engine(processor) as engine: ...``. Closing
    it cancels and joins every task it started. ``fetcher`` and ``decoder`` replace the network
    fetcher and the Pillow decoder (test seams, as httpx's ``MockTransport``; the render server's
    decoder applies vLLM's loading rule); the engine does not open or close a fetcher it was
    given. ``hasher`` replaces how encoded items are identified (:class:`~.stages.Hasher`; the
    render server's gives vLLM's mm_hashes).
    """

    def __init__(
        self,
        processor: BaseMultiModalProcessor,
        config: EngineConfig | None = None,
        *,
        adapter_id: str | None = None,
        fetcher: Fetcher | None = None,
        decoder: Decoder | None = None,
        hasher: Hasher | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        cfg = self.config
        self.device = DeviceStage(
            cfg.device,
            cfg.visual_dtype,
            staging_buffers=cfg.device_staging_buffers,
            buffer_bytes=cfg.device_staging_buffer_bytes,
            max_buffer_bytes=cfg.device_staging_max_buffer_bytes,
            host_output_bytes=cfg.host_output_pool_bytes,
        )
        self.processor = self._with_device_resize(processor)
        self.adapter_id = adapter_id or type(processor).__name__
        resize_on = "device-resize" if self.processor.resize_device is not None else "cpu-resize"
        self._fingerprint = (
            f"{self.adapter_id}:{getattr(processor, 'backend', None)}:{processor.transform}"
            f":{resize_on}"
        )
        self._normalize_mode = "device" if processor.device_normalize else "cpu"
        self._given_fetcher = fetcher
        self._hasher = hasher
        #: the decode limit in force (``decode.max_pixels``, else Pillow's bomb limit)
        self.max_pixels = cfg.decode.resolved_max_pixels()
        self._decoder: Decoder = decoder or PillowDecoder(cfg.decode, max_pixels=self.max_pixels)
        #: the decode fidelity in force: ``fast`` needs the Pillow decoder itself (a subclass may
        #: convert differently) and a native transform
        self.fidelity: Fidelity = cfg.decode.fidelity
        if self.fidelity == "fast" and (
            type(self._decoder) is not PillowDecoder or self.processor.transform != "native"
        ):
            log.warning("fast_fidelity_unavailable", decoder=type(self._decoder).__name__,
                        transform=self.processor.transform)  # fmt: skip
            self.fidelity = "exact"
        self._tg: anyio.abc.TaskGroup | None = None
        self._counted = False  # counted among the process's open engines (aiomm.tuning.malloc)
        self._stack: contextlib.AsyncExitStack | None = None
        self._pipeline: Pipeline | None = None
        self._recorder = StageRecorder()
        self._images = 0
        #: requests admitted and not yet done (:meth:`_admitted`)
        self._in_pipeline = 0
        self._videos = 0
        self._audios = 0
        #: how audio items are decoded and resampled (None: the adapter takes no audio)
        self._audio: AudioLoader | None = None
        if "audio" in self.processor.supported_modalities:
            self._audio = AudioLoader.of(
                cfg.decode,
                self.processor.audio_sampling_rate,
                self.processor.audio_resample_method,
            )
        self._budget = ByteBudget(cfg.max_decoded_bytes_in_flight)
        self.admission = AdmissionStage(
            cfg.max_in_flight, cfg.waiting_bound(), network_slots=cfg.network_slots()
        )

    # ------------------------------------------------------------------ construction

    def _with_device_resize(self, processor: BaseMultiModalProcessor) -> BaseMultiModalProcessor:
        """The processor, resizing on the engine's device when ``mm_device_resize`` says so.

        :raises ConfigError: if device resize is requested for an adapter that cannot do it.
        """
        wanted = self.config.mm_device_resize
        capable = (
            processor.supports_device_resize
            and processor.transform == "native"
            and processor.device_normalize
        )
        if wanted is None:
            wanted = capable and self.device.device.type == "cuda"
        if not wanted:
            return processor
        if not capable:
            raise ConfigError(
                f"mm_device_resize needs an adapter whose native transform is a plain resize "
                f"with device normalisation; {type(processor).__name__} "
                f"(transform={processor.transform}) keeps the CPU path"
            )
        processor = copy.copy(processor)
        processor.resize_device = self.device.device
        return processor

    @classmethod
    def from_pretrained(
        cls,
        path_or_architecture: str | Path,
        config: EngineConfig | None = None,
        *,
        backend: str = "torchvision",
    ) -> Engine:
        """An engine for a local model folder or a registered architecture / short name.

        A folder is loaded with ``AutoProcessor.from_pretrained``; a name builds the reference HF
        processor offline from the architecture's documented parameters.

        :raises UnknownArchitectureError: if the architecture has no adapter.
        """
        from aiomm import adapters

        config = config or EngineConfig()
        path = Path(path_or_architecture)
        if path.is_dir():
            processor = adapters.from_pretrained(path, config=config.processing)
            return cls(processor, config, adapter_id=str(path.resolve()))
        name = str(path_or_architecture)
        info = adapters.get_adapter_info(name)
        processor = adapters.build_processor(name, config=config.processing, backend=backend)
        return cls(processor, config, adapter_id=info.short_name)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Engine:
        if self._tg is not None:
            raise EngineClosedError("this Engine is already open")
        cfg = self.config
        tracing_enabled()  # spans from here on when the host configured OpenTelemetry
        # Process-wide settings, only those the configuration asks for (aiomm.tuning): the last
        # engine to close undoes them (aiomm.tuning.malloc).
        memory.engine_opened()
        self._counted = True
        if cfg.torch_threads is not None and cfg.torch_threads != torch.get_num_threads():
            threads_before = torch.get_num_threads()
            torch.set_num_threads(cfg.torch_threads)
            memory.undo_on_last_close(
                "torch_threads", lambda: torch.set_num_threads(threads_before)
            )
        if cfg.decode.pillow_blocks_kept is not None:
            blocks_before = pillow_blocks_limit()
            keep_pillow_blocks(cfg.decode.pillow_blocks_kept)
            memory.undo_on_last_close("pillow_blocks", lambda: release_pillow_blocks(blocks_before))
        if cfg.tune_malloc and tune_malloc():
            memory.undo_on_last_close("malloc", memory.untune_malloc)
        stack = contextlib.AsyncExitStack()
        try:
            fetcher = self._given_fetcher
            if fetcher is None:
                fetcher = await stack.enter_async_context(MediaFetcher(cfg.fetch))
            shared = await self._open_shared_cache(stack)
            tg = await stack.enter_async_context(anyio.create_task_group())
        except BaseException:
            await stack.aclose()
            self._release_process_settings()
            raise
        assert fetcher is not None  # the one given, or the MediaFetcher opened above
        if self.device.pool is not None and self.device.device.type == "cuda":
            # pinned allocation is slow and takes locks: do it before the first request
            await self.device.pool.preallocate()
        self._stack, self._tg = stack, tg
        item_cache = ItemCache(tg, capacity_bytes=cfg.cache_capacity_bytes, second_tier=shared)
        if shared is not None:
            try:
                # a read on another process's behalf refreshes the item: its only copy may be here
                await shared.start(functools.partial(item_cache.peek, refresh=True))
            except ConfigError:
                await self.aclose()
                raise
        self._pipeline = Pipeline(
            load=LoadStage(fetcher, cfg.fetch_concurrency),
            hash=HashStage(
                cfg.transform_threads,
                in_thread_bytes=cfg.hash_in_thread_bytes,
                max_pixels=self.max_pixels,
                max_video_frames=cfg.decode.max_video_frames,
                max_video_bytes=cfg.decode.max_video_bytes,
                hasher=self._hasher,
                audio=self._audio,
            ),
            cache=CacheStage(
                item_cache,
                # fast and exact items differ: they never share a cache entry
                fingerprint=self._fingerprint
                + ("" if self.fidelity == "exact" else f":{self.fidelity}"),
                normalize_mode=self._normalize_mode,
                enabled=cfg.cache_capacity_bytes > 0 or shared is not None,
                trust_supplied_hashes=cfg.trust_supplied_hashes,
            ),
            transform=TransformStage(
                self.processor,
                self._decoder,
                threads=cfg.transform_threads,
                budget=self._budget,
                fidelity=self.fidelity,
                video_limits=VideoLimits(
                    cfg.decode.max_video_frames, cfg.decode.max_video_bytes, self.max_pixels
                ),
                inline_bytes=cfg.hash_in_thread_bytes,
                audio=self._audio,
            ),
            assemble=AssembleStage(self.processor),
            output=OutputStage(self.device),
            return_items=cfg.return_items,
        )
        log.info("engine_open", adapter=self.adapter_id, transform=self.processor.transform,
                 normalize=self._normalize_mode, device=str(self.device.device))  # fmt: skip
        return self

    async def _open_shared_cache(self, stack: contextlib.AsyncExitStack) -> SecondTier | None:
        """The Redis tier of ``shared_cache_url`` (closed by ``stack`` after the task group), else
        the worker tier of ``peer_cache_dir`` (started once the item cache exists), or None.
        Redis being down is logged, not raised: the engine computes locally meanwhile.

        :raises ConfigError: if the ``redis`` client is not installed.
        """
        url = self.config.shared_cache_url
        if url is None:
            # the worker tier serves items from this process's cache: without one, every link
            # it announced would only send peers on a round trip to a miss
            if self.config.peer_cache_dir is None or self.config.cache_capacity_bytes == 0:
                return None
            peer = PeerItemCache(self.config.peer_cache_dir)
            stack.push_async_callback(peer.aclose)
            return peer
        try:
            from aiomm.cache.redis import SharedItemCache
        except ImportError as exc:
            raise ConfigError(
                "shared_cache_url needs the redis client: pip install 'aiomm[shared-cache]' "
                f"({exc})"
            ) from exc
        shared = SharedItemCache(url, self.config.shared_cache)
        stack.push_async_callback(shared.aclose)
        await shared.probe()
        return shared

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel and join everything the engine started; idempotent.

        Closing the last open engine of the process also gives memory back: Pillow's kept
        blocks are freed, the process-wide settings the engines changed are restored and the
        heap is trimmed (see :mod:`aiomm.tuning.malloc` for what stays).
        """
        if self._tg is None or self._stack is None:
            self._release_process_settings()
            return
        tg, stack = self._tg, self._stack
        self._tg = self._stack = None
        tg.cancel_scope.cancel()
        try:
            # Exits the task group (joining every task) and closes the fetcher. It must run in
            # the task that opened the engine, with no cancel scope of ours around it.
            await stack.aclose()
        finally:
            if self._pipeline is not None:
                with anyio.CancelScope(shield=True):
                    await self._pipeline.transform.workers.aclose()
            if self.device.host_outputs is not None:
                # results still held by callers keep their memory; idle blocks go now
                self.device.host_outputs.clear()
            self._release_process_settings()
        log.info("engine_closed", adapter=self.adapter_id)

    def _release_process_settings(self) -> None:
        if self._counted:
            self._counted = False
            memory.release_after_last_engine()

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        """The engine's task group.

        :raises EngineClosedError: if the engine is not open.
        """
        if self._tg is None:
            raise EngineClosedError("the engine is not open: use 'async with engine:'")
        return self._tg

    # ------------------------------------------------------------------ public API

    async def process(self, request: Request, *, device: bool = True) -> Result:
        """Process one request.

        ``device=False`` skips the device stage: ``mm_kwargs`` stay on the CPU as the transform
        made them (``pixel_values`` uint8 and not normalised when the adapter normalises on the
        device, merged in the model's layout), for callers that store or ship the rows.

        :raises AiommError: the typed error of the first item or stage that failed, carrying
            the request id (and the item index where one item failed).
        :raises EngineClosedError: if the engine is not open.
        """
        rid = request.request_id or random_hex(6)
        return await self._process_request(rid, request, device)

    async def plan(self, request: Request) -> Result:
        """The routing plan of one request: its prompt token ids with the placeholders
        expanded, the placeholder ranges and each item's id and cache key, as :meth:`process`
        gives them, without processing a pixel.

        Each item's size comes from its header where the header decides it (a complete JPEG or
        PNG, a video read to its end: :mod:`aiomm.media.header`), else from decoding it; it is
        never resized or patchified. A processed item or a plan cached for the same key
        answers at once. ``Result.items`` holds each item's prompt fields (e.g.
        ``image_grid_thw``); ``mm_kwargs`` is empty. A request :meth:`process` would refuse is
        refused with the same error.

        :raises AiommError: as :meth:`process`.
        :raises EngineClosedError: if the engine is not open.
        """
        rid = request.request_id or random_hex(6)
        return await self._process_request(rid, request, False, plan=True)

    async def plan_safe(self, request: Request) -> Result:
        """Like :meth:`plan`, but a failure becomes ``Result.error`` instead of raising."""
        rid = request.request_id or random_hex(6)
        try:
            return await self._process_request(rid, request, False, plan=True)
        except AiommError as exc:
            return Result(request_id=rid, error=exc)

    async def process_safe(self, request: Request, *, device: bool = True) -> Result:
        """Like :meth:`process`, but a failure becomes ``Result.error`` instead of raising."""
        rid = request.request_id or random_hex(6)
        try:
            return await self._process_request(rid, request, device)
        except AiommError as exc:
            return Result(request_id=rid, error=exc)

    async def _process_request(
        self, rid: str, request: Request, device: bool, *, plan: bool = False
    ) -> Result:
        self.task_group  # noqa: B018  (raises EngineClosedError when closed)
        assert self._pipeline is not None
        attributes = {
            "aiomm.images": len(request.images),
            "aiomm.videos": len(request.videos),
            "aiomm.audios": len(request.audios),
            "aiomm.plan": plan,
        }
        with span("aiomm.request", attributes):
            return await self._traced_request(rid, request, device, plan)

    async def _traced_request(self, rid: str, request: Request, device: bool, plan: bool) -> Result:
        assert self._pipeline is not None
        t0, wall0 = time.perf_counter(), time.time_ns()
        timings: dict[str, float] = {}
        try:
            sources = (*request.images, *request.videos, *request.audios)
            network = any(is_network(source) for source in sources)
            async with self.admission.admit(network=network):
                timings["admission"] = time.perf_counter() - t0
                past_span("aiomm.admission", wall0, time.time_ns())
                self._admitted(1)
                try:
                    result = await self._pipeline.run(
                        rid, request, timings, device=device, plan=plan
                    )
                except AiommError:
                    raise
                except Exception as exc:
                    # A bug or an unexpected library error still reaches the caller typed.
                    raise ProcessingError(
                        f"internal error while processing: {type(exc).__name__}: {exc}"
                    ).with_context(request_id=rid) from exc
                finally:
                    self._admitted(-1)
        except AiommError as error:
            error.with_context(request_id=rid)
            timings["total"] = time.perf_counter() - t0
            log.warning("request_failed", request_id=rid, error=type(error).__name__,
                        message=str(error), timings_ms=_ms(timings))  # fmt: skip
            raise
        timings["total"] = time.perf_counter() - t0
        if not plan:
            self._images += len(request.images)
            self._videos += len(request.videos)
            self._audios += len(request.audios)
        self._recorder.record_all(timings)
        if log.isEnabledFor(logging.DEBUG):  # the event's fields cost more than the check
            log.debug("request_done", request_id=rid, timings_ms=_ms(timings),
                      cache=[c.value for c in result.cache])  # fmt: skip
        return result

    def _admitted(self, change: int) -> None:
        """Count the requests in the pipeline; with ``busy_transform_threads`` set, all the
        transform threads run for one request alone, that many for two or more."""
        self._in_pipeline += change
        busy = self.config.busy_transform_threads
        if busy is not None and self._pipeline is not None:
            threads = self.config.transform_threads if self._in_pipeline <= 1 else busy
            self._pipeline.transform.workers.set_limit(threads)

    def stream(
        self,
        requests: Iterable[Request] | AsyncIterable[Request],
        *,
        ordered: bool = True,
        max_in_flight: int | None = None,
        raise_errors: bool = False,
        plan: bool = False,
    ) -> ResultStream:
        """Stream results for ``requests``; use as ``async with engine.stream(src) as results:``.

        Requests are pulled from the source only as capacity frees up: at most ``max_in_flight``
        requests (default ``config.max_in_flight``) have been taken from the source and not yet
        yielded, so a slow consumer stops the producer. ``ordered=False`` yields in completion
        order. A failed request yields a ``Result`` carrying its typed error, unless
        ``raise_errors`` is set. ``plan=True`` yields routing plans (:meth:`plan`) instead.

        :raises EngineClosedError: if the engine is not open when iteration starts.
        """
        return ResultStream(
            lambda: self.task_group,
            self.plan_safe if plan else self.process_safe,
            requests,
            ordered=ordered,
            max_in_flight=max_in_flight or self.config.max_in_flight,
            raise_errors=raise_errors,
        )

    async def clear_cache(self) -> None:
        """Drop every item of the in-process cache; work in flight will not repopulate it.

        The shared Redis tier is left alone: other replicas read it too.
        """
        if self._pipeline is not None:
            await self._pipeline.cache.cache.clear()

    def stats(self) -> EngineStats:
        """Counters, per-stage latency percentiles, queue depths, cache and fetch statistics."""
        requests = self.admission.request_statistics()
        stages: dict[str, StageStatistics] = {"admission": requests.queue}
        pipeline = self._pipeline
        if pipeline is not None:
            stages.update({stage.name: stage.statistics() for stage in pipeline.stages})
        device_stats = self.device.statistics()
        queues = {
            name: LimiterStats(s.capacity, s.in_use, s.waiting, s.limit)
            for name, s in (
                ("requests", stages["admission"]),
                ("fetch", stages.get("fetch")),
                ("hash", stages.get("hash")),
                ("transform", stages.get("transform")),
            )
            if s is not None
        }
        lane = requests.network
        queues["network"] = LimiterStats(lane.capacity, lane.in_use, lane.waiting, lane.limit)
        workers = self.device.workers.statistics()
        device_slots = int(workers.total_tokens)
        queues["device"] = LimiterStats(
            device_slots, workers.borrowed_tokens, workers.tasks_waiting, device_slots
        )
        pool = device_stats.pool_capacity
        queues["device_staging"] = LimiterStats(
            pool, device_stats.pool_in_use, device_stats.pool_waiting, pool
        )
        return EngineStats(
            requests_started=requests.started,
            requests_completed=requests.completed,
            requests_failed=requests.failed,
            requests_cancelled=requests.cancelled,
            requests_shed=requests.shed,
            images_processed=self._images,
            videos_processed=self._videos,
            audios_processed=self._audios,
            bytes_to_device=self.device.bytes_moved,
            stages=self._recorder.snapshot(),
            queues=queues,
            stage_statistics=stages,
            decoded_bytes=self._budget.statistics(),
            device=device_stats,
            cache=None if pipeline is None else pipeline.cache.cache_statistics(),
            fetch=None if pipeline is None else pipeline.load.fetcher.statistics(),
            plans={} if pipeline is None else dict(pipeline.plans),
            transform_busy_seconds=0.0
            if pipeline is None
            else pipeline.transform.workers.statistics().busy_seconds,
        )


def _ms(timings: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v * 1000, 3) for k, v in timings.items()}
