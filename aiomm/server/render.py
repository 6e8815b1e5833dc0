"""The render service: a parsed request -> vLLM's ``GenerateRequest`` JSON object.

The engine (:func:`render_engine`) fetches the images, videos and audio clips (``data:`` URLs
decoded, ``http(s)`` through the SSRF-guarded fetcher, ``file:`` under the allowed root),
identifies them by vLLM's mm_hash (:class:`~aiomm.vllm.media.VllmHasher`) and processes them
(images decoded with vLLM's rule, videos probed and sampled as vLLM's loader does:
:class:`~aiomm.vllm.media.VllmDecoder`, audio decoded and resampled as vLLM's audio loader
and data parser do); the service renders the prompt around them and writes
the result as vLLM writes it (:mod:`aiomm.vllm.generate_request`). A client ``uuid`` is the
item's mm_hash and its cache key, as in vLLM.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from aiomm.adapters import hf_class_name
from aiomm.config import EngineConfig, available_cores
from aiomm.engine import Engine
from aiomm.engine._worker_pool import WorkerPool
from aiomm.errors import (
    AiommError,
    ItemCountMismatchError,
    ProcessingError,
)
from aiomm.tracing import span
from aiomm.types import Request
from aiomm.vllm.chat_template import ChatRenderer
from aiomm.vllm.content import Parsed, media_url
from aiomm.vllm.errors import ApiError, from_aiomm_error
from aiomm.vllm.generate_request import (
    WireForm,
    counter_ids,
    encode_items,
    generate_request,
    generate_request_features,
    order_modalities,
    place_payload,
    rename_modalities,
)
from aiomm.vllm.media import VllmDecoder, VllmHasher
from aiomm.vllm.request_fields import own_fields, refuse_nulls
from aiomm.vllm.request_values import flag
from aiomm.vllm.rules import (
    TEMPLATE_FLAGS,
    TEMPLATE_KWARGS_REFUSED,
    TOOL_CHOICE,
    completion_prompts,
    parallel_tool_calls,
    refuse_unreproduced,
    request_id_of,
    template_extras,
    tool_choice_of,
    truncated,
    truncated_expanded,
)
from aiomm.vllm.sampling import SamplingDefaults, derive
from aiomm.vllm.video_media import VIDEOS_PER_PROMPT, video_loader

if sys.version_info < (3, 11):  # pragma: no cover
    pass

__all__ = ("RenderLimits", "RenderService", "Rendered", "render_engine", "vllm_video_loader")


_HASH_ON_LOOP_BYTES = 1 << 20


@dataclass(frozen=True)
class RenderLimits:
    """Per-request limits of the server."""

    max_images: int = 16
    timeout_s: float = 120.0
    max_videos: int = 4
    #: encoded bytes of one video at most (the fetcher's ``max_bytes`` applies first)
    max_video_bytes: int = 64 << 20
    #: audio clips per request (vLLM's ``--limit-mm-per-prompt`` for audio, in its words)
    max_audios: int = 4


def vllm_video_loader(processor: Any) -> str | None:
    """The vLLM video loader of ``processor``'s model (None: videos are not rendered)."""
    return video_loader(hf_class_name(getattr(processor, "video_processor", None)))


def render_engine(
    folder: str | Path,
    config: EngineConfig,
    *,
    model_id: str,
    limits: RenderLimits | None = None,
) -> Engine:
    """The engine of a render server of ``folder`` (not opened): images decoded with vLLM's
    loading rule, videos probed and sampled as vLLM's loader does (:class:`VllmDecoder`), every
    item identified by vLLM's mm_hash for a server of ``model_id`` (:class:`VllmHasher`; a
    client ``uuid`` instead, when given), and cached by it."""
    base = Engine.from_pretrained(folder, config)
    decoder = VllmDecoder(
        config.decode,
        max_pixels=base.max_pixels,
        video_loader=vllm_video_loader(base.processor) or "qwen2_vl",
    )
    hasher = VllmHasher(
        model_id,
        decoder,
        max_video_bytes=(limits or RenderLimits()).max_video_bytes,
        audio_sampling_rate=base.processor.audio_sampling_rate,
        # (a server that names items by request counts needs no pixel hash)
        vision_chunk=getattr(base.processor, "wire_modality", None) == "vision_chunk"
        and not counts_requests(base.processor, config),
    )
    return Engine(
        base.processor, config, adapter_id=base.adapter_id, decoder=decoder, hasher=hasher
    )


def counts_requests(processor: Any, config: EngineConfig) -> bool:
    """Whether vLLM's render server names ``processor``'s items by request counts, not content
    hashes: its CPU render server turns prefix caching off for an MLA text model (Kimi-K2.5's)
    and, with the processor cache off too (``config``'s item cache), hashes nothing."""
    return bool(getattr(processor, "mla_text_model", False)) and config.cache_capacity_bytes == 0


@dataclass
class Rendered:
    """One rendered request: the response object and what metrics count."""

    response: dict[str, Any]
    images: int
    cache_hits: int
    #: seconds per engine stage
    timings: dict[str, float] = field(default_factory=dict)


class RenderService:
    """Turns chat, Responses, Anthropic and completion requests into ``GenerateRequest``s."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        served_names: Sequence[str],
        defaults: SamplingDefaults,
        limits: RenderLimits | None = None,
        float_dtype: torch.dtype | None = None,
        encode_threads: int | None = None,
        encode_on_send: bool = False,
    ) -> None:
        """``engine``: one made by :func:`render_engine` (vLLM's loading rule and mm_hashes).
        ``float_dtype``: what floating-point tensors are cast to on the wire, as vLLM casts them
        to the model's dtype (:func:`model_float_dtype`); None keeps them. ``encode_threads``:
        threads writing the items' wire form (default: one per core); :meth:`aclose` ends them.
        ``encode_on_send``: they write the items' documents and casts only, and the tensors'
        base64 is made as the response sends it (:func:`encode_items`' ``lazy``)."""
        loader = vllm_video_loader(engine.processor)
        #: whether vLLM's video loader for this model is one aiomm reproduces
        self.takes_videos = loader is not None
        #: how vLLM writes this model's items (encode_items)
        self.wire = WireForm.of(engine.processor)
        self.video_loader = loader or "qwen2_vl"
        #: GLM-4V: vLLM's prompt update replaces ``<|begin_of_video|><|video|><|end_of_video|>``,
        #: so its video ranges cover both delimiters (the engine's cover the expansion between)
        self.video_delimiters: tuple[int, int] | None = None
        if loader in ("glm4v", "glm46v"):
            bov, eov = tokenizer.convert_tokens_to_ids(["<|begin_of_video|>", "<|end_of_video|>"])
            self.video_delimiters = (int(bov), int(eov))
        if loader == "glm46v" and hasattr(engine.processor, "whole_second_timestamps"):
            # vLLM's GLM-OCR prompt writes each patch's whole seconds, where HF's are fractional
            engine.processor.whole_second_timestamps = True
        self.engine = engine
        self.float_dtype = float_dtype
        self.chat = ChatRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.served_names = tuple(served_names)
        self.defaults = defaults
        self.limits = limits or RenderLimits()
        # a pool of its own, not anyio's: handing a job to anyio's worker threads (a Python
        # queue and condition) took 5% of the event loop's busy time under the render benchmark
        self.encode_pool = WorkerPool(encode_threads or available_cores(), "aiomm-encode")
        self.encode_on_send = encode_on_send
        #: vLLM's count of multimodal requests where it names items by it (counts_requests;
        #: None: content hashes)
        self.mm_requests = (
            itertools.count(1) if counts_requests(engine.processor, engine.config) else None
        )

    async def aclose(self) -> None:
        """End the encode threads (after the items being written)."""
        await self.encode_pool.aclose()

    # ------------------------------------------------------------------ helpers

    def check_model(self, body: dict[str, Any], api: str = "chat") -> str | None:
        """The request's model as it names it, which its ``GenerateRequest`` echoes: None or
        ``""`` (vLLM then serves its model; Anthropic's API requires a name) or a served name.

        :raises ApiError: 404 for an unknown model, 400 for a model that is not a string or, on
            the Anthropic API, a missing or empty one.
        """
        model = body.get("model")
        if api == "messages" and model in (None, ""):
            # pydantic's and the Anthropic model's validator's words, as vLLM answers
            raise ApiError(
                "Field required"
                if "model" not in body
                else "Input should be a valid string"
                if model is None
                else "Model is required",
                param="model",
            )
        if model is not None and not isinstance(model, str):
            raise ApiError("'model' must be a string", param="model")
        if model and model not in self.served_names:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
        return model

    # ------------------------------------------------------------------ render

    async def render(
        self,
        parsed: Parsed,
        body: dict[str, Any],
        *,
        api: str = "chat",
        header_id: str | None = None,
    ) -> Rendered:
        """Render a parsed request to ``api``: ``"chat"``, ``"responses"`` or ``"messages"``
        (Anthropic); ``header_id``: the request's ``X-Request-Id`` header.

        :raises ApiError: a 4xx for the client's mistakes, 5xx for ours.
        """
        model = self.check_model(body, api)
        body = own_fields(body, api)  # what the API's request model lacks, vLLM never reads
        refuse_nulls(body, api)
        refuse_unreproduced(body, api)
        payload = body.get("mm_payload", "tensors")
        if body.get("return_mm_kwargs") is False:
            payload = "none"
        if payload not in ("tensors", "none"):
            raise ApiError("mm_payload must be 'tensors' or 'none'", param="mm_payload")
        if len(parsed.images) > self.limits.max_images:
            raise ApiError(
                f"too many images: {len(parsed.images)}, the limit is "
                f"{self.limits.max_images} per request"
            )
        if body.get("media_io_kwargs"):
            # vLLM would sample (and hash) with them; rendering without them would differ
            raise ApiError(
                "media_io_kwargs is not supported: videos are sampled with vLLM's defaults",
                param="media_io_kwargs",
            )
        self._check_modalities(parsed)
        # vLLM 0.33 answers a vision_chunk model's (Kimi-K2.5's) video with a 500 (it hands the
        # video on undivided); a client's part the model cannot take is a 400 here, as for others
        if parsed.videos and not self.takes_videos:
            raise ApiError(
                "this model's videos are not supported (video_url parts are rendered for "
                "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, GLM-OCR, LLaVA-OneVision and Gemma 4)",
                param="video_url",
            )
        most = VIDEOS_PER_PROMPT.get(self.video_loader)
        if most is not None and len(parsed.videos) > most:
            raise ApiError(
                f"At most {most} video(s) may be provided in one prompt.", param="video"
            )  # vLLM's own words
        if len(parsed.videos) > self.limits.max_videos:
            raise ApiError(
                f"too many videos: {len(parsed.videos)}, the limit is "
                f"{self.limits.max_videos} per request",
                param="video_url",
            )
        template_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, dict):
            raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        # a template of the client's own would run on the server (and is refused at the top
        # level); ``tokenize`` would change what the template call returns. vLLM's words:
        if unexpected := sorted(TEMPLATE_KWARGS_REFUSED & template_kwargs.keys()):
            raise ApiError(
                "Found unexpected chat template kwargs from request: "
                + "{" + ", ".join(repr(k) for k in unexpected) + "}",
                param="chat_template_kwargs",
            )  # fmt: skip
        add_gen = flag(body, "add_generation_prompt", True)
        cont = flag(body, "continue_final_message", False)
        if parsed.continue_final:
            add_gen, cont = False, True
        template_kwargs = {**template_kwargs, **template_extras(body, template_kwargs)}
        prompt_ids = await self.chat.arender(
            parsed.conversation,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            # the request's own flags win over the same keys in its template kwargs (vLLM's merge)
            kwargs={k: v for k, v in template_kwargs.items() if k not in TEMPLATE_FLAGS},
        )
        uncut = len(prompt_ids)
        if body.get("truncate_prompt_tokens") is not None:
            # before the placeholders are expanded, then again after (vLLM cuts twice)
            prompt_ids = truncated(prompt_ids, body, self.defaults.max_model_len)
        # read before the media are fetched: a bad field is a 400 without a fetch
        tool_choice = TOOL_CHOICE[api]
        include_reasoning = flag(body, "include_reasoning", True)
        if tool_choice is None:  # Responses: read, and nothing in vLLM's answer changes
            include_reasoning = True
        parse_context = None
        if tool_choice is not None:
            parse_context = {
                "tools": None,
                "tool_choice": tool_choice_of(body, tool_choice, api),
                "parallel_tool_calls": parallel_tool_calls(body, api),
                "include_reasoning": include_reasoning,
                "chat_template_kwargs": {
                    "cohere_format": "cmd4",
                    **template_kwargs,
                    "add_generation_prompt": add_gen,
                    "continue_final_message": cont,
                },
                "history_tool_call_cnt": parsed.tool_call_count,
            }
        features = None
        cache_hits = 0
        timings: dict[str, float] = {}
        if parsed.images or parsed.videos or parsed.audios:
            # the body's fields are checked before its media are fetched, as vLLM checks them
            derive(body, self.defaults, len(prompt_ids), api=api)
            generate_request([], None, model=model, sampling_params={}, body=body)
            request_id_of(body, api, header_id)
            try:
                with anyio.fail_after(self.limits.timeout_s):
                    features, prompt_ids, cache_hits, timings = await self._features(
                        parsed, prompt_ids, tensors=payload == "tensors"
                    )
            except TimeoutError:
                raise ApiError(
                    f"the request's media took longer than {self.limits.timeout_s} s",
                    status=408,
                    type="TimeoutError",
                ) from None
            except ApiError as exc:
                cut_a_placeholder = isinstance(exc.__cause__, ItemCountMismatchError)
                if not cut_a_placeholder or len(prompt_ids) == uncut:
                    raise
                # vLLM answers 500 ("Failed to apply prompt replacement"): the client's cut
                raise ApiError(
                    f"truncate_prompt_tokens={body['truncate_prompt_tokens']} cut the prompt's "
                    "placeholder of a multimodal item before the placeholders were expanded. "
                    "Please raise truncate_prompt_tokens or shorten the multimodal input.",
                    param="truncate_prompt_tokens",
                ) from exc
        if features is not None and body.get("truncate_prompt_tokens") is not None:
            prompt_ids = truncated_expanded(prompt_ids, features, body, self.defaults.max_model_len)
        sampling = derive(body, self.defaults, len(prompt_ids), api=api)
        response = generate_request(
            prompt_ids,
            features,
            model=model,
            sampling_params=sampling,
            request_id=request_id_of(body, api, header_id),
            parse_context=parse_context,
            body=body,
        )
        if api == "messages" and response["stream"]:
            # vLLM's Anthropic endpoint streams with usage in every event
            response["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if not include_reasoning:
            response["reasoning_ended"] = True  # vLLM: no reasoning is parsed from the output
        return Rendered(
            response,
            len(parsed.images) + len(parsed.videos) + len(parsed.audios),
            cache_hits,
            timings,
        )

    def _check_modalities(self, parsed: Parsed) -> None:
        """Refuse images or audio clips the model does not take, or more clips than the limit,
        with vLLM's words (its parser counts each part against ``--limit-mm-per-prompt``, and a
        model's unsupported modality has a limit of 0).

        :raises ApiError: 400 naming the modality.
        """
        takes = self.engine.processor.supported_modalities
        for modality, parts in (("image", parsed.images), ("audio", parsed.audios)):
            if parts and modality not in takes:
                raise ApiError(
                    f"At most 0 {modality}(s) may be provided in one prompt.", param=modality
                )
        most = self.limits.max_audios
        if len(parsed.audios) > most:
            raise ApiError(f"At most {most} audio(s) may be provided in one prompt.", param="audio")

    async def render_text(
        self, body: dict[str, Any], *, header_id: str | None = None
    ) -> list[dict[str, Any]]:
        """``/v1/completions/render``: one ``GenerateRequest`` per prompt (text or token ids).

        :raises ApiError: a missing or malformed prompt, or an unknown model.
        """
        model = self.check_model(body)
        body = own_fields(body, "completion")  # what the completion model lacks is ignored
        refuse_nulls(body, "completion")
        refuse_unreproduced(body, "completion")
        out = []
        prompts = completion_prompts(body.get("prompt"))
        base = request_id_of(body, "completion", header_id)
        texts = iter(await self.chat.aencode_all([p for p in prompts if isinstance(p, str)]))
        for i, p in enumerate(prompts):
            ids = next(texts) if isinstance(p, str) else p
            ids = truncated(ids, body, self.defaults.max_model_len)
            if not ids:
                raise ApiError("a prompt rendered no token ids", param="prompt")
            sampling = derive(body, self.defaults, len(ids), api="completion")
            rid = base if len(prompts) == 1 else f"{base}-{i}"  # vLLM's ids for a batch
            out.append(
                generate_request(
                    ids, None, model=model, sampling_params=sampling, request_id=rid, body=body
                )
            )
        return out

    async def _features(
        self,
        parsed: Parsed,
        prompt_ids: list[int],
        *,
        tensors: bool,
    ) -> tuple[dict[str, Any], list[int], int, dict[str, float]]:
        # the engine fetches, identifies (vLLM's mm_hash, or the client's uuid) and caches
        images, videos, audios = (
            [media_url(p.url) if p.data is None else p.data for p in parts]
            for parts in (parsed.images, parsed.videos, parsed.audios)
        )
        # a request's items are its images, then its videos, then its audio clips
        n_images, n_videos = len(images), len(videos)
        request = Request(
            prompt_token_ids=prompt_ids,
            images=images,
            image_hashes=[part.uuid for part in parsed.images],
            videos=videos,  # sampled by VllmDecoder.sample_video, as vLLM's loader
            video_hashes=[part.uuid for part in parsed.videos],
            audios=audios,  # decoded and resampled as vLLM's AudioMediaIO and data parser
            audio_hashes=[part.uuid for part in parsed.audios],
        )
        try:
            # without tensors, the routing plan: the same ids, hashes and placeholders, no pixels
            result = await (self.engine.process(request) if tensors else self.engine.plan(request))
        except AiommError as exc:
            if self.mm_requests is not None and isinstance(exc, ProcessingError):
                next(self.mm_requests)  # vLLM counted the request before its processor failed
            raise from_aiomm_error(exc) from exc
        hits = sum(1 for c in result.cache if c.value == "hit")
        ids = result.item_ids
        # vLLM's chat parser hands its processor images, audio, then videos (mm_hashes' order)
        by_modality = {
            "image": ids[:n_images],
            "audio": ids[n_images + n_videos :],
            "video": ids[n_images : n_images + n_videos],
        }
        if self.mm_requests is not None:
            uuids = {"image": [p.uuid for p in parsed.images]}
            by_modality = counter_ids(
                next(self.mm_requests), by_modality, uuids, self.wire.modality_names
            )
        feats = generate_request_features(result, by_modality, tensors=False)
        if self.video_delimiters is not None:
            _widen_ranges(
                feats["mm_placeholders"].get("video", []),
                result.prompt_token_ids,
                self.video_delimiters,
            )
        if tensors:
            # megabytes of casts, copying and base64 per image: off the event loop (with
            # encode_on_send only the casts and documents, the base64 as the response is sent)
            try:
                with span("aiomm.encode"):
                    kwargs_data, metadata = await self.encode_pool.run(
                        functools.partial(
                            encode_items,
                            result.items,
                            self.wire,
                            float_dtype=self.float_dtype,
                            lazy=self.encode_on_send,
                        )
                    )
            except AiommError as exc:  # the pool closed: the server is stopping (503)
                raise from_aiomm_error(exc) from exc
            place_payload(feats, result.items, kwargs_data, metadata)
        order_modalities(feats, self.wire.modality_order)
        rename_modalities(feats, self.wire.modality_names)
        return feats, result.prompt_token_ids, hits, result.timings


def _widen_ranges(
    ranges: list[dict[str, int]], ids: Sequence[int], around: tuple[int, int]
) -> None:
    """Extend each ``{"offset", "length"}`` range over the tokens ``around`` it (when they are
    there), in place."""
    first, last = around
    for r in ranges:
        start, end = r["offset"] - 1, r["offset"] + r["length"]
        if start >= 0 and end < len(ids) and ids[start] == first and ids[end] == last:
            r["offset"], r["length"] = start, r["length"] + 2
