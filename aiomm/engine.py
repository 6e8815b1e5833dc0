"""The Engine: an async context manager owning the pipeline's task group, pools, cache and device.

A request flows through these stages; each stage's capacity is bounded by an ``EngineConfig``
field, so a stage that falls behind makes the stages before it wait (backpressure all the way up
to ``stream()``'s source):

=============  =========================================  ==================================
stage          work                                       runs on / bounded by
=============  =========================================  ==================================
admission      one slot per request                       loop; ``max_in_flight``
fetch          URL / data URL / path -> encoded bytes     loop (async I/O); ``fetch_concurrency``
hash           blake3 of encoded bytes or pixels          loop, or a thread for large inputs
cache          per-item lookup, single-flight join         loop
decode         probe size, admit bytes, decode to RGB     threads; ``transform_threads`` and
transform      resize + patchify (uint8), per item        ``max_decoded_bytes_in_flight``
assemble       prompt updates, placeholder ranges         loop
device         normalise to ``visual_dtype`` on device    threads (the wait for the GPU too)
=============  =========================================  ==================================
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import numpy as np
import structlog
import torch

from aiomm.admission import ByteBudget, ByteBudgetStatistics
from aiomm.config import EngineConfig
from aiomm.decode import decode_image, image_from_object, keep_pillow_blocks, probe_image_size
from aiomm.device import DeviceStage, DeviceStageStatistics
from aiomm.errors import AiommError, EngineClosedError, ProcessingError
from aiomm.fetch import MediaFetcher
from aiomm.hashing import hash_bytes, hash_pixels, item_cache_key
from aiomm.item_cache import CacheOutcome, ItemCache
from aiomm.memory import tune_malloc
from aiomm.processing.fields import MultiModalKwargsItem, concat_parts, merge_items
from aiomm.processing.processor import BaseMultiModalProcessor
from aiomm.stats import LatencyStats, StageRecorder
from aiomm.stream import ResultStream
from aiomm.types import Request, Result

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ("Engine", "EngineStats")

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LimiterStats:
    capacity: int
    in_use: int
    waiting: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters, queues and latencies."""

    requests_started: int
    requests_completed: int
    requests_failed: int
    images_processed: int
    bytes_to_device: int
    stages: dict[str, LatencyStats]
    queues: dict[str, LimiterStats]
    decoded_bytes: ByteBudgetStatistics
    cache: Any
    fetch: Any
    device: DeviceStageStatistics


@dataclass
class _Counters:
    started: int = 0
    completed: int = 0
    failed: int = 0
    images: int = 0
    bytes_to_device: int = 0


def _is_in_memory(source: Any) -> bool:
    return not isinstance(source, (bytes, bytearray, memoryview, str, Path)) and not hasattr(
        source, "__fspath__"
    )


class Engine:
    """Async preprocessing engine for one model adapter.

    Use it as an async context manager: ``async with Engine(processor) as engine: ...``. Closing
    it cancels and joins every task it started.
    """

    def __init__(
        self,
        processor: BaseMultiModalProcessor,
        config: EngineConfig | None = None,
        *,
        adapter_id: str | None = None,
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
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._fetcher: MediaFetcher | None = None
        self._cache: ItemCache | None = None
        self._local = threading.local()
        self._recorder = StageRecorder()
        self._counters = _Counters()
        self._request_limiter = anyio.CapacityLimiter(cfg.max_in_flight)
        self._fetch_limiter = anyio.CapacityLimiter(cfg.fetch_concurrency)
        self._transform_limiter = anyio.CapacityLimiter(cfg.transform_threads)
        # Matches the staging pool, so CPU and CUDA admit the same requests to the device stage.
        self._device_limiter = anyio.CapacityLimiter(cfg.device_staging_buffers)
        self._budget = ByteBudget(cfg.max_decoded_bytes_in_flight)

    # ------------------------------------------------------------------ construction

    def _with_device_resize(self, processor: BaseMultiModalProcessor) -> BaseMultiModalProcessor:
        """The processor, resizing on the engine's device when ``mm_device_resize`` says so.

        :raises ValueError: if device resize is requested for an adapter that cannot do it.
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
            raise ValueError(
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
            raise RuntimeError("this Engine is already open")
        if self.config.torch_threads is not None:
            torch.set_num_threads(self.config.torch_threads)
        keep_pillow_blocks(self.config.pillow_blocks_kept())
        if self.config.tune_malloc:
            tune_malloc()
        stack = contextlib.AsyncExitStack()
        try:
            self._fetcher = await stack.enter_async_context(MediaFetcher(self.config.fetch))
            tg = await stack.enter_async_context(anyio.create_task_group())
        except BaseException:
            await stack.aclose()
            raise
        if self.device.pool is not None and self.device.device.type == "cuda":
            # pinned allocation is slow and takes locks: do it before the first request
            await self.device.pool.preallocate()
        self._stack, self._tg = stack, tg
        self._cache = ItemCache(tg, capacity_bytes=self.config.cache_capacity_bytes)
        log.info("engine_open", adapter=self.adapter_id, transform=self.processor.transform,
                 normalize=self._normalize_mode, device=str(self.device.device))  # fmt: skip
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel and join everything the engine started; idempotent."""
        if self._tg is None or self._stack is None:
            return
        tg, stack = self._tg, self._stack
        self._tg = self._stack = None
        tg.cancel_scope.cancel()
        # Exits the task group (joining every task) and closes the fetcher. It must run in the
        # task that opened the engine, with no cancel scope of ours around it.
        await stack.aclose()
        if self.device.host_outputs is not None:
            # results still held by callers keep their memory; idle blocks go now
            self.device.host_outputs.clear()
        log.info("engine_closed", adapter=self.adapter_id)

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise EngineClosedError("the engine is not open: use 'async with engine:'")
        return self._tg

    # ------------------------------------------------------------------ public API

    async def process(self, request: Request) -> Result:
        """Process one request.

        :raises AiommError: the typed error of the first item or stage that failed.
        :raises EngineClosedError: if the engine is not open.
        """
        return await self._process_request(request.request_id or uuid.uuid4().hex[:12], request)

    async def process_safe(self, request: Request) -> Result:
        """Like :meth:`process`, but a failure becomes ``Result.error`` instead of raising."""
        rid = request.request_id or uuid.uuid4().hex[:12]
        try:
            return await self._process_request(rid, request)
        except AiommError as exc:
            return Result(request_id=rid, error=exc)

    async def _process_request(self, rid: str, request: Request) -> Result:
        self.task_group  # noqa: B018  (raises EngineClosedError when closed)
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        self._counters.started += 1
        try:
            async with self._request_limiter:
                timings["admission"] = time.perf_counter() - t0
                result = await self._process(rid, request, timings)
        except Exception as exc:
            self._counters.failed += 1
            timings["total"] = time.perf_counter() - t0
            error = (
                exc
                if isinstance(exc, AiommError)
                else ProcessingError(
                    # A bug or an unexpected library error still reaches the caller typed.
                    f"internal error while processing: {type(exc).__name__}: {exc}"
                )
            )
            log.warning("request_failed", request_id=rid, error=type(error).__name__,
                        message=str(error), timings_ms=_ms(timings))  # fmt: skip
            if error is exc:
                raise
            raise error from exc
        timings["total"] = time.perf_counter() - t0
        self._counters.completed += 1
        self._recorder.record_all(timings)
        log.debug("request_done", request_id=rid, timings_ms=_ms(timings),
                  cache=[c.value for c in result.cache])  # fmt: skip
        return result

    def stream(
        self,
        requests: Iterable[Request] | AsyncIterable[Request],
        *,
        ordered: bool = True,
        max_in_flight: int | None = None,
        raise_errors: bool = False,
    ) -> ResultStream:
        """Stream results for ``requests``; use as ``async with engine.stream(src) as results:``.

        Requests are pulled from the source only as capacity frees up: at most ``max_in_flight``
        requests (default ``config.max_in_flight``) have been taken from the source and not yet
        yielded, so a slow consumer stops the producer. ``ordered=False`` yields in completion
        order. A failed request yields a ``Result`` carrying its typed error, unless
        ``raise_errors`` is set.
        """
        return ResultStream(
            self,
            requests,
            ordered=ordered,
            max_in_flight=max_in_flight or self.config.max_in_flight,
            raise_errors=raise_errors,
        )

    async def clear_cache(self) -> None:
        """Drop every cached item; work in flight will not repopulate it."""
        if self._cache is not None:
            await self._cache.clear()

    def stats(self) -> EngineStats:
        """Counters, per-stage latency percentiles, queue depths, cache and fetch statistics."""

        def lim(limiter: anyio.CapacityLimiter) -> LimiterStats:
            s = limiter.statistics()
            return LimiterStats(int(s.total_tokens), s.borrowed_tokens, s.tasks_waiting)

        c = self._counters
        device_stats = self.device.statistics()
        return EngineStats(
            requests_started=c.started,
            requests_completed=c.completed,
            requests_failed=c.failed,
            images_processed=c.images,
            bytes_to_device=self.device.bytes_moved,
            stages=self._recorder.snapshot(),
            queues={
                "requests": lim(self._request_limiter),
                "fetch": lim(self._fetch_limiter),
                "transform": lim(self._transform_limiter),
                "device": lim(self._device_limiter),
                "device_staging": LimiterStats(
                    device_stats.pool_capacity, device_stats.pool_in_use, device_stats.pool_waiting
                ),
            },
            decoded_bytes=self._budget.statistics(),
            device=device_stats,
            cache=None if self._cache is None else self._cache.statistics(),
            fetch=None if self._fetcher is None else self._fetcher.statistics(),
        )

    # ------------------------------------------------------------------ the pipeline

    async def _process(self, rid: str, request: Request, timings: dict[str, float]) -> Result:
        kwargs = dict(request.mm_processor_kwargs or {})
        self.processor.validate_hf_kwargs(kwargs)
        prompt_ids = self._prompt_ids(request)
        hashes = list(request.image_hashes or [None] * len(request.images))
        n = len(request.images)
        items: list[MultiModalKwargsItem | None] = [None] * n
        keys: list[str] = [""] * n
        outcomes: list[CacheOutcome] = [CacheOutcome.UNCACHED] * n
        item_timings: list[dict[str, float]] = [{} for _ in range(n)]

        async def one(i: int) -> None:
            items[i], keys[i], outcomes[i] = await self._load_item(
                request.images[i], hashes[i], kwargs, item_timings[i]
            )

        try:
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        for t in item_timings:
            for stage, seconds in t.items():
                timings[stage] = timings.get(stage, 0.0) + seconds

        t = time.perf_counter()
        mm_kwargs = {"image": [it for it in items if it is not None]} if n else {}
        processed = self.processor.assemble(prompt_ids, mm_kwargs, kwargs)
        timings["assemble"] = time.perf_counter() - t

        t = time.perf_counter()
        all_items = [item for group in processed.mm_kwargs.values() for item in group]
        # The device stage's one host copy merges the pixel rows: no batch copy on the event loop.
        parts = concat_parts(all_items, "pixel_values")
        merged = merge_items(all_items, skip=("pixel_values",) if parts is not None else ())
        pixels = parts.tensors if parts is not None else merged.get("pixel_values")
        if pixels is not None:
            repeat = parts.repeat if parts is not None else None
            async with self._device_limiter:
                merged["pixel_values"] = await self.device.run(
                    pixels, processed.normalization, repeat=repeat
                )
        timings["device"] = time.perf_counter() - t
        self._counters.images += n
        return Result(
            request_id=rid,
            prompt_token_ids=processed.prompt_token_ids,
            mm_placeholders=processed.mm_placeholders,
            mm_kwargs=merged,
            item_hashes=keys,
            cache=outcomes,
            timings=timings,
        )

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        tokenizer = getattr(self.processor.hf_processor, "tokenizer", None)
        if tokenizer is None:
            raise ProcessingError("this adapter has no tokenizer: pass prompt_token_ids")
        return list(tokenizer(request.prompt, add_special_tokens=False)["input_ids"])

    def _key(self, content_hash: str, kwargs: Mapping[str, Any]) -> str:
        return item_cache_key(
            content_hash,
            adapter=self._fingerprint,
            processor_kwargs=kwargs,
            normalize_mode=self._normalize_mode,
        )

    async def _load_item(
        self,
        source: Any,
        supplied_hash: str | None,
        kwargs: Mapping[str, Any],
        timings: dict[str, float],
    ) -> tuple[MultiModalKwargsItem, str, CacheOutcome]:
        assert self._cache is not None
        cache = self._cache
        if supplied_hash is not None:
            # A trusted-as-key hash: a hit skips the download entirely.
            key = self._key(f"supplied:{supplied_hash}", kwargs)
            hit = cache.peek(key)
            if hit is not None:
                return hit, key, CacheOutcome.HIT

        raw: Any
        t = time.perf_counter()
        if _is_in_memory(source):
            # RGB conversion once, here: the hash and the transform both use this array.
            raw = await anyio.to_thread.run_sync(
                image_from_object, source, limiter=self._transform_limiter
            )
        else:
            assert self._fetcher is not None
            async with self._fetch_limiter:
                raw = await self._fetcher.fetch(source)
        timings["fetch"] = time.perf_counter() - t

        if supplied_hash is None:
            t = time.perf_counter()
            content_hash = await self._hash(raw)
            timings["hash"] = time.perf_counter() - t
            key = self._key(content_hash, kwargs)

        async def compute() -> MultiModalKwargsItem:
            return await self._compute_item(raw, kwargs, timings)

        t = time.perf_counter()
        if self.config.cache_capacity_bytes == 0:
            item, outcome = await compute(), CacheOutcome.UNCACHED
        else:
            item, outcome = await cache.get_or_compute(key, compute)
        timings["cache_and_compute"] = time.perf_counter() - t
        return item, key, outcome

    async def _hash(self, raw: Any) -> str:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            if len(raw) >= self.config.hash_in_thread_bytes:
                return await anyio.to_thread.run_sync(hash_bytes, raw)
            return hash_bytes(raw)
        if raw.nbytes >= self.config.hash_in_thread_bytes:
            return await anyio.to_thread.run_sync(hash_pixels, raw)
        return hash_pixels(raw)

    async def _compute_item(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            data = bytes(raw)
            max_pixels = self.config.decode.max_pixels
            width, height = await anyio.to_thread.run_sync(
                probe_image_size, data, max_pixels, limiter=self._transform_limiter
            )

            def load() -> np.ndarray:
                return decode_image(data, max_pixels=max_pixels)
        else:  # already an RGB array (converted in _load_item)
            height, width = raw.shape[0], raw.shape[1]

            def load() -> np.ndarray:
                return raw

        nbytes = int(width) * int(height) * 3
        await self._budget.acquire(nbytes)
        try:
            t = time.perf_counter()
            item = await anyio.to_thread.run_sync(
                self._transform, load, dict(kwargs), limiter=self._transform_limiter
            )
            timings["decode_transform"] = time.perf_counter() - t
        finally:
            self._budget.release(nbytes)
        return item

    def _transform(self, load: Any, kwargs: dict[str, Any]) -> MultiModalKwargsItem:
        """Worker thread: decode and transform one image."""
        image = load()
        processor = self._thread_processor()
        out = processor.process_items({"image": [image]}, kwargs)
        device = processor.resize_device
        if device is not None and device.type == "cuda":
            # Items made on the device are cached and read from other streams: complete them first.
            torch.cuda.current_stream(device).synchronize()
        return out["image"][0]

    def _thread_processor(self) -> BaseMultiModalProcessor:
        # HF fast tokenizers are not thread-safe, so the hf path gets a processor per thread; the
        # native transform only reads the processor's parameters and is shared.
        if self.processor.transform == "native":
            return self.processor
        proc = getattr(self._local, "processor", None)
        if proc is None:
            proc = self._local.processor = self.processor.clone()
        return proc


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first AiommError in a (nested) exception group, else the group itself."""
    for exc in _leaves(group):
        if isinstance(exc, AiommError):
            return exc
    return group


def _leaves(group: BaseExceptionGroup) -> Sequence[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _ms(timings: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v * 1000, 3) for k, v in timings.items()}
