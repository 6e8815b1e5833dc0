"""The pipeline: composes the stages for one request (the only module that knows them all).

``load -> hash -> cache (-> transform on a miss)`` runs per item (image, video or audio),
concurrently for a request's items; ``assemble -> output`` runs once per request. A routing plan
runs ``load -> hash -> cache (-> the transform stage's plan on a miss) -> assemble``: no pixels.
Admission happens in the engine, before a request enters. Errors are typed and carry the request id
(and the item index where one item failed); a request's other items are cancelled with it, other
requests go on."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from aiomm.cache.item_cache import CacheOutcome
from aiomm.engine.stages import (
    AssembleStage,
    CacheStage,
    HashStage,
    LoadStage,
    OutputStage,
    TransformStage,
)
from aiomm.engine.stages.load import is_in_memory
from aiomm.errors import AiommError, ProcessingError, UnknownModalityError, first_error
from aiomm.processing.fields import MultiModalKwargsItem
from aiomm.tracing import set_attribute, span
from aiomm.types import Request, Result

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ("PLAN_SOURCES", "Pipeline")

#: how an item's routing plan was made (``Pipeline.plans``)
PLAN_SOURCES = ("header", "decoded", "processed", "cached")


@dataclass
class _Item:
    """One item's way through the per-item stages."""

    item: MultiModalKwargsItem | None = None
    key: str = ""
    #: the supplied or computed id (``Result.item_ids``)
    id: str = ""
    outcome: CacheOutcome = CacheOutcome.UNCACHED


class Pipeline:
    """Runs one request through the stages; see the module docstring."""

    def __init__(
        self,
        *,
        load: LoadStage,
        hash: HashStage,
        cache: CacheStage,
        transform: TransformStage,
        assemble: AssembleStage,
        output: OutputStage,
        return_items: bool = False,
    ) -> None:
        self.load = load
        self.hash = hash
        self.cache = cache
        self.transform = transform
        self.assemble = assemble
        self.output = output
        self.return_items = return_items
        self.stages = (load, hash, cache, transform, assemble, output)
        #: routing plans made, by how: from the ``header``, ``decoded``, ``processed`` (an
        #: adapter that cannot plan), ``cached`` (a processed item or a plan of the same key)
        self.plans: dict[str, int] = dict.fromkeys(PLAN_SOURCES, 0)

    async def run(
        self,
        rid: str,
        request: Request,
        timings: dict[str, float],
        *,
        device: bool = True,
        plan: bool = False,
    ) -> Result:
        """Process ``request`` (already admitted); ``device=False`` skips the device stage;
        ``plan=True`` makes its routing plan instead (no pixels, :meth:`Engine.plan`).

        :raises AiommError: the first typed error of an item or a stage, with ``rid`` (and the
            item's index) attached; an unexpected exception becomes a ``ProcessingError``.
        """
        try:
            return await self._run(rid, request, timings, device, plan)
        except AiommError as exc:
            exc.with_context(request_id=rid)
            raise

    async def _run(
        self, rid: str, request: Request, timings: dict[str, float], device: bool, plan: bool
    ) -> Result:
        kwargs = dict(request.mm_processor_kwargs or {})
        self.transform.processor.validate_hf_kwargs(kwargs)
        videos = list(request.videos)
        audios = list(request.audios)
        supported = self.transform.processor.supported_modalities
        for modality, given in (("image", request.images), ("video", videos), ("audio", audios)):
            if given and modality not in supported:
                raise UnknownModalityError(modality, supported)
        prompt_ids = self.assemble.prompt_ids(request)
        n_images = len(request.images)
        # a request's items: its images, then its videos, then its audios (``item_index``
        # counts across all three)
        sources = [*request.images, *videos, *audios]
        kinds = ["image"] * n_images + ["video"] * len(videos) + ["audio"] * len(audios)
        n = len(sources)
        trusted = self.cache.trust_supplied_hashes
        hashes: Sequence[str | None] = [
            *((trusted and request.image_hashes) or [None] * n_images),
            *((trusted and request.video_hashes) or [None] * len(videos)),
            *((trusted and request.audio_hashes) or [None] * len(audios)),
        ]
        items = [_Item() for _ in range(n)]
        item_timings: list[dict[str, float]] = [{} for _ in range(n)]

        load_item = self._plan_item if plan else self._load_item

        async def one(i: int) -> None:
            kind = kinds[i]
            try:
                await load_item(
                    kind, sources[i], hashes[i], request.tenant, kwargs, items[i], item_timings[i]
                )
            except AiommError as exc:
                exc.with_context(request_id=rid, item_index=i)
                raise
            except Exception as exc:
                raise ProcessingError(
                    f"internal error while processing {kind} {i}: {type(exc).__name__}: {exc}"
                ).with_context(request_id=rid, item_index=i) from exc

        if n == 1:
            await one(0)  # no task group for the common single-image request
        elif n:
            try:
                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(one, i)
            except BaseExceptionGroup as group:
                raise first_error(group) from None
        for item_timing in item_timings:
            for stage, seconds in item_timing.items():
                timings[stage] = timings.get(stage, 0.0) + seconds

        t = time.perf_counter()
        loaded = [it.item for it in items]
        assert all(item is not None for item in loaded)
        with span("aiomm.assemble"):
            processed = self.assemble.assemble(
                prompt_ids,
                loaded[:n_images],  # type: ignore[arg-type]
                kwargs,
                videos=loaded[n_images : n_images + len(videos)],  # type: ignore[arg-type]
                audios=loaded[n_images + len(videos) :],  # type: ignore[arg-type]
                normalization=not plan,
            )
        timings["assemble"] = time.perf_counter() - t
        # the items as assembled (an adapter may fit an item to the request: Qwen3-Omni's clips
        # take the padding of the request's longest one)
        loaded = [
            item for modality in ("image", "video", "audio")
            for item in processed.mm_kwargs.get(modality, ())
        ]  # fmt: skip

        if plan:
            return Result(
                request_id=rid,
                prompt_token_ids=processed.prompt_token_ids,
                mm_placeholders=processed.mm_placeholders,
                item_hashes=[it.key for it in items],
                item_ids=[it.id for it in items],
                items=list(loaded),  # type: ignore[arg-type]
                cache=[it.outcome for it in items],
                timings=timings,
                fidelity=self.transform.fidelity,
            )
        merged: dict[str, Any] = {}
        if not device or not self.return_items:
            # host rows (device=False) are merged in a worker thread even with return_items
            t = time.perf_counter()
            with span("aiomm.device", {"aiomm.device": device}):
                merged = await (self.output.run if device else self.output.run_host)(processed)
            timings["device"] = time.perf_counter() - t
        return Result(
            request_id=rid,
            prompt_token_ids=processed.prompt_token_ids,
            mm_placeholders=processed.mm_placeholders,
            mm_kwargs=merged,
            item_hashes=[it.key for it in items],
            item_ids=[it.id for it in items],
            items=list(loaded) if self.return_items else [],  # type: ignore[arg-type]
            cache=[it.outcome for it in items],
            timings=timings,
            fidelity=self.transform.fidelity,
        )

    async def _load_item(
        self,
        kind: str,
        source: Any,
        supplied_id: str | None,
        tenant: str | None,
        kwargs: Mapping[str, Any],
        out: _Item,
        timings: dict[str, float],
    ) -> None:
        """One image or video: fetched, identified, looked up, transformed on a miss. A video's
        key is in a namespace of its own (its bytes never share an image's entry), and holds the
        processor kwargs (the sampling parameters among them)."""
        cache = self.cache
        if supplied_id is not None:
            # An id given by the client keys the item: a hit in any tier skips even the
            # download, so the download is part of the computation.
            out.id = supplied_id
            out.key = self._key(kind, supplied_id, kwargs, supplied=True, tenant=tenant)
            hit = cache.lookup(out.key)
            if hit is not None:
                out.item, out.outcome = hit, CacheOutcome.HIT
                return

            async def load_and_compute() -> MultiModalKwargsItem:
                raw = await self._fetch(source, timings)
                if is_in_memory(raw):
                    raw, _ = await self._hash(kind, raw, timings)  # converted here
                return await self._compute(kind, raw, kwargs, timings)

            t = time.perf_counter()
            with span("aiomm.cache") as current:
                out.item, out.outcome = await cache.get_or_compute(out.key, load_and_compute)
                set_attribute(current, "aiomm.cache.outcome", out.outcome.value)
            timings["cache_and_compute"] = time.perf_counter() - t
            return

        raw, out.id = await self._hash(kind, await self._fetch(source, timings), timings)
        out.key = self._key(kind, out.id, kwargs)

        async def compute() -> MultiModalKwargsItem:
            return await self._compute(kind, raw, kwargs, timings)

        t = time.perf_counter()
        with span("aiomm.cache") as current:
            out.item, out.outcome = await cache.get_or_compute(out.key, compute)
            set_attribute(current, "aiomm.cache.outcome", out.outcome.value)
        timings["cache_and_compute"] = time.perf_counter() - t

    async def _plan_item(
        self,
        kind: str,
        source: Any,
        supplied_id: str | None,
        tenant: str | None,
        kwargs: Mapping[str, Any],
        out: _Item,
        timings: dict[str, float],
    ) -> None:
        """One item's routing plan: the cached item or plan of its key, else the transform
        stage's plan (which reads the header, or decodes), else the item processed and cached
        as :meth:`_load_item` would (an adapter that cannot plan)."""
        cache = self.cache
        if supplied_id is not None:
            out.id = supplied_id
            out.key = self._key(kind, supplied_id, kwargs, supplied=True, tenant=tenant)
            if self._planned_before(out):
                return
            raw = await self._fetch(source, timings)
            if is_in_memory(raw):
                raw, _ = await self._hash(kind, raw, timings)
        else:
            raw, out.id = await self._hash(kind, await self._fetch(source, timings), timings)
            out.key = self._key(kind, out.id, kwargs)
            if self._planned_before(out):
                return
        item: MultiModalKwargsItem | None = None
        how = "processed"  # audio has no plan of its own: it is processed (and cached)
        if kind != "audio":
            make = self.transform.plan if kind == "image" else self.transform.plan_video
            with span("aiomm.plan", {"aiomm.modality": kind}) as current:
                item, how = await make(raw, kwargs, timings)
                set_attribute(current, "aiomm.plan.source", how)
        if item is None:

            async def compute() -> MultiModalKwargsItem:
                return await self._compute(kind, raw, kwargs, timings)

            out.item, out.outcome = await cache.get_or_compute(out.key, compute)
        else:
            out.item, out.outcome = item, CacheOutcome.MISS
            cache.plan_store(out.key, item)
        self.plans[how] += 1

    def _key(
        self,
        kind: str,
        item_id: str,
        kwargs: Mapping[str, Any],
        *,
        supplied: bool = False,
        tenant: str | None = None,
    ) -> str:
        """An item's cache key (:meth:`CacheStage.key`), a video's and an audio's each in a
        namespace of its own."""
        namespace = "" if kind == "image" else f"{kind}:"
        return self.cache.key(namespace + item_id, kwargs, supplied=supplied, tenant=tenant)

    def _planned_before(self, out: _Item) -> bool:
        """Take the processed item or the plan cached for ``out.key``, if there is one."""
        found = self.cache.lookup(out.key) or self.cache.plan_lookup(out.key)
        if found is None:
            return False
        out.item, out.outcome = found, CacheOutcome.HIT
        self.plans["cached"] += 1
        return True

    async def _compute(
        self, kind: str, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        with span("aiomm.transform", {"aiomm.modality": kind}):
            if kind == "image":
                return await self.transform.compute(raw, kwargs, timings)
            if kind == "audio":
                return await self.transform.compute_audio(raw, kwargs, timings)
            return await self.transform.compute_video(raw, kwargs, timings)

    async def _fetch(self, source: Any, timings: dict[str, float]) -> Any:
        t = time.perf_counter()
        with span("aiomm.fetch"):
            raw = await self.load.load(source)
        timings["fetch"] = time.perf_counter() - t
        return raw

    async def _hash(self, kind: str, raw: Any, timings: dict[str, float]) -> tuple[Any, str]:
        t = time.perf_counter()
        with span("aiomm.hash"):
            if kind == "image":
                raw, item_id = await self.hash.hash(raw)
            elif kind == "audio":
                raw, item_id = await self.hash.hash_audio(raw)
            else:
                raw, item_id = await self.hash.hash_video(raw)
        timings["hash"] = time.perf_counter() - t
        return raw, item_id
