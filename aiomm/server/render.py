"""The render service: a parsed request -> vLLM's ``GenerateRequest`` JSON object.

Images and videos are fetched (``data:`` URLs decoded, ``http(s)`` through the SSRF-guarded
fetcher, ``file:`` under the allowed root), hashed as vLLM hashes them (:mod:`.mm_hash`) and
processed by the engine (images decoded with vLLM's rule, :mod:`.media`; videos probed and
sampled as vLLM's loader does, :mod:`.video_media`); each item is then written in vLLM's msgpack
layout (:mod:`.kwargs_codec`). A client ``uuid`` is the item's mm_hash and its cache key, as in
vLLM.
"""

from __future__ import annotations

import binascii
import functools
import io
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
import PIL.Image
import pybase64
import torch

from aiomm.adapters import hf_class_name
from aiomm.config import available_cores
from aiomm.engine import Engine
from aiomm.error_groups import first_error
from aiomm.errors import (
    AiommError,
    DecodeError,
    DownloadTooLargeError,
    InvalidSourceError,
    ItemCountMismatchError,
)
from aiomm.fetch import MediaFetcher
from aiomm.processing.fields import (
    FieldKind,
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    PaddedImageField,
)
from aiomm.processing.image_ops import numpy_copyable
from aiomm.request_ids import random_hex
from aiomm.types import Request, Result
from aiomm.video import VideoInfo, decode_video, sampled_bytes
from aiomm.worker_pool import WorkerPool

from .chat_template import ChatRenderer
from .content import ImagePart, Parsed
from .data_urls import is_base64_header, payload_size, payload_too_large
from .errors import ApiError, from_aiomm_error
from .json_chunks import PiecesString
from .kwargs_codec import Field, WireRows, encode_item_lazy, encode_item_pieces
from .media import VllmDecoder, converts_mode
from .mm_hash import image_mm_hash, video_mm_hash
from .request_fields import own_fields, refuse_nulls
from .request_values import flag, lax_bool, lax_int
from .sampling import SamplingDefaults, derive
from .video_media import VIDEOS_PER_PROMPT, hash_metadata, video_loader

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = (
    "RenderLimits",
    "RenderService",
    "Rendered",
    "WireForm",
    "generate_request",
    "generate_request_features",
    "model_float_dtype",
    "vllm_mm_hash",
)

#: keys vLLM keeps on the CPU (sent again as ``mm_metadata``)
_KEEP_ON_CPU = frozenset(
    {
        "image_grid_thw",
        "video_grid_thw",
        "second_per_grid_ts",
        "timestamps",
        "image_num_patches",
        "image_token_id",
    }
)
#: wire order of an item's keys (vLLM's with PYTHONHASHSEED=0); other keys follow
_KEY_ORDER = (
    "image_token_id",
    "image_num_patches",
    "pixel_values_flat",
    "timestamps",
    "pixel_values",
    "image_grid_thw",
    "second_per_grid_ts",
    "video_grid_thw",
    "pixel_values_videos",
)
_MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_float_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype vLLM casts an item's floating-point tensors to (``model_config.dtype`` with
    ``--dtype auto``: the folder's ``torch_dtype``); None when the config names none."""
    try:
        config = orjson.loads((Path(folder) / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    if name is None and isinstance(config.get("text_config"), dict):
        name = config["text_config"].get("torch_dtype") or config["text_config"].get("dtype")
    return _MODEL_DTYPES.get(str(name)) if name else None


_HASH_ON_LOOP_BYTES = 1 << 20


@dataclass(frozen=True)
class RenderLimits:
    """Per-request limits of the server."""

    max_images: int = 16
    timeout_s: float = 120.0
    max_videos: int = 4
    #: encoded bytes of one video at most (the fetcher's ``max_bytes`` applies first)
    max_video_bytes: int = 64 << 20


#: keys an HF processor returns that vLLM's processor for it drops (absent from its fields
#: config), by HF processor class: Mistral 3's items carry only ``pixel_values``
_DROPPED_KEYS: dict[str, frozenset[str]] = {"PixtralProcessor": frozenset({"image_sizes"})}
#: keys vLLM's processor names otherwise, by HF processor class: the InternVL-style processors
#: (Llama Nemotron VL) send their tiles as ``pixel_values_flat``
_RENAMED_KEYS: dict[str, dict[str, str]] = {
    "NemotronVLReference": {"pixel_values": "pixel_values_flat"}
}
#: the processors whose items carry the image token's id as a ``shared`` field kept on the CPU
#: (vLLM's InternVL-style processors: the model picks the embedding positions with it), by HF
#: processor class: the adapter attribute holding the id
_TOKEN_ID_FIELD: dict[str, str] = {"NemotronVLReference": "img_context_id"}


@dataclass(frozen=True)
class WireForm:
    """How vLLM 0.33's render server writes a model's items, which its multimodal processor
    decides (:meth:`of` a processor)."""

    #: each video item's flat fields describe only its own rows: vLLM's Qwen3-VL processes the
    #: videos one at a time (images are always processed in one call, so an image item's
    #: slices describe the request's whole image batch)
    per_video_slices: bool = False
    #: an item's prompt timestamps are sent as its ``timestamps`` field (Qwen3-VL's video items;
    #: GLM-4V's keep them in the prompt only)
    timestamps_field: bool = True
    #: keys the HF processor returns that vLLM's drops (:data:`_DROPPED_KEYS`)
    dropped_keys: frozenset[str] = frozenset()
    #: keys vLLM names otherwise (:data:`_RENAMED_KEYS`)
    renamed_keys: Mapping[str, str] = field(default_factory=dict)
    #: an image item's ``image_token_id`` (a ``shared`` int64 scalar kept on the CPU, batch size
    #: the request's images), as vLLM's InternVL-style items carry it; None: no such field
    image_token_id: int | None = None

    @classmethod
    def of(cls, processor: Any) -> WireForm:
        """The wire form of ``processor``'s items (an aiomm adapter)."""
        loader = video_loader(hf_class_name(getattr(processor, "video_processor", None)))
        qwen3 = loader == "qwen3_vl"
        family = hf_class_name(getattr(processor, "hf_processor", None))
        token_attribute = _TOKEN_ID_FIELD.get(family)
        return cls(
            per_video_slices=qwen3,
            timestamps_field=qwen3 or loader is None,
            dropped_keys=_DROPPED_KEYS.get(family, frozenset()),
            renamed_keys=_RENAMED_KEYS.get(family, {}),
            image_token_id=None
            if token_attribute is None
            else int(getattr(processor, token_attribute)),
        )


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
        model_id: str,
        served_names: Sequence[str],
        defaults: SamplingDefaults,
        fetcher: MediaFetcher,
        limits: RenderLimits | None = None,
        float_dtype: torch.dtype | None = None,
        decoder: VllmDecoder | None = None,
        encode_threads: int | None = None,
        encode_on_send: bool = False,
    ) -> None:
        """``float_dtype``: what floating-point tensors are cast to on the wire, as vLLM casts
        them to the model's dtype (:func:`model_float_dtype`); None keeps them. ``decoder``: the
        engine's, whose video headers the hashes reuse. ``encode_threads``: threads writing the
        items' wire form (default: one per core); :meth:`aclose` ends them. ``encode_on_send``:
        they write the items' documents and casts only, and the tensors' base64 is made as the
        response sends it (:func:`encode_items`' ``lazy``)."""
        video_processor = getattr(engine.processor, "video_processor", None)
        loader = video_loader(hf_class_name(video_processor))
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
        self.decoder = decoder or VllmDecoder(video_loader=loader or "qwen2_vl")
        self.engine = engine
        self.float_dtype = float_dtype
        self.chat = ChatRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.served_names = tuple(served_names)
        self.defaults = defaults
        self.fetcher = fetcher
        self.limits = limits or RenderLimits()
        # a pool of its own, not anyio's: handing a job to anyio's worker threads (a Python
        # queue and condition) took 5% of the event loop's busy time under the render benchmark
        self.encode_pool = WorkerPool(encode_threads or available_cores(), "aiomm-encode")
        self.encode_on_send = encode_on_send

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

    async def _media_bytes(self, part: ImagePart) -> bytes:
        if part.data is not None:
            return part.data
        try:
            if part.url[:5].lower() == "data:":
                return self._data_url(part.url)
            return await self.fetcher.fetch(part.url)
        except AiommError as exc:
            raise from_aiomm_error(exc) from exc

    def _data_url(self, url: str) -> bytes:
        """A base64 ``data:`` URL's bytes, decoded with SIMD base64 (the stdlib's validating
        decoder costs ~6 ms per megabyte; this ~0.1 ms, so it stays on the loop).

        :raises InvalidSourceError, DownloadTooLargeError: malformed, or above the size limit.
        """
        # slices, not a partition of url[5:]: each copy of a megabyte string is fresh memory
        comma = url.find(",", 5)
        header = url[5:comma] if comma >= 0 else url[5:45]
        shown = f"data:{header[:40]},..."
        if comma < 0 or not is_base64_header(header):
            raise InvalidSourceError(
                "image data URLs must be data:<mime>;base64,<payload>", source=shown
            )
        limit = self.fetcher.config.max_bytes
        if payload_too_large(len(url) - comma - 1, limit):
            decoded = payload_size(len(url) - comma - 1)
            raise DownloadTooLargeError(
                f"data URL payload of about {decoded} bytes is above the limit of {limit} bytes",
                source=shown,
            )
        payload = url[comma + 1 :]
        try:
            return pybase64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidSourceError(
                f"malformed base64 in the data URL's {len(payload)}-character payload: {exc}",
                source=shown,
            ) from exc

    def _hash(self, data: bytes) -> str:
        try:
            return vllm_mm_hash(data, self.model_id)
        except AiommError as exc:
            raise from_aiomm_error(exc) from exc

    async def _mm_hash(self, data: bytes) -> str:
        if len(data) < _HASH_ON_LOOP_BYTES:
            return self._hash(data)
        return await anyio.to_thread.run_sync(self._hash, data)

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
        if parsed.videos and not self.takes_videos:
            raise ApiError(
                "this model's videos are not supported (video_url parts are rendered for "
                "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V and GLM-OCR)",
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
        if unexpected := sorted(_TEMPLATE_KWARGS_REFUSED & template_kwargs.keys()):
            raise ApiError(
                "Found unexpected chat template kwargs from request: "
                + "{" + ", ".join(repr(k) for k in unexpected) + "}",
                param="chat_template_kwargs",
            )  # fmt: skip
        add_gen = flag(body, "add_generation_prompt", True)
        cont = flag(body, "continue_final_message", False)
        if parsed.continue_final:
            add_gen, cont = False, True
        template_kwargs = {**template_kwargs, **_template_extras(body, template_kwargs)}
        prompt_ids = await self.chat.arender(
            parsed.conversation,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            # the request's own flags win over the same keys in its template kwargs (vLLM's merge)
            kwargs={k: v for k, v in template_kwargs.items() if k not in _TEMPLATE_FLAGS},
        )
        uncut = len(prompt_ids)
        if body.get("truncate_prompt_tokens") is not None:
            # before the placeholders are expanded, then again after (vLLM cuts twice)
            prompt_ids = truncated(prompt_ids, body, self.defaults.max_model_len)
        # read before the media are fetched: a bad field is a 400 without a fetch
        tool_choice = _TOOL_CHOICE[api]
        include_reasoning = flag(body, "include_reasoning", True)
        if tool_choice is None:  # Responses: read, and nothing in vLLM's answer changes
            include_reasoning = True
        parse_context = None
        if tool_choice is not None:
            parse_context = {
                "tools": None,
                "tool_choice": _tool_choice(body, tool_choice, api),
                "parallel_tool_calls": _parallel_tool_calls(body, api),
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
        if parsed.images or parsed.videos:
            # the body's fields are checked before its media are fetched, as vLLM checks them
            derive(body, self.defaults, len(prompt_ids), api=api)
            generate_request([], None, model=model, sampling_params={}, body=body)
            _request_id(body, api, header_id)
            try:
                with anyio.fail_after(self.limits.timeout_s):
                    features, prompt_ids, cache_hits, timings = await self._features(
                        parsed.images, parsed.videos, prompt_ids, tensors=payload == "tensors"
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
            request_id=_request_id(body, api, header_id),
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
            len(parsed.images) + len(parsed.videos),
            cache_hits,
            timings,
        )

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
        prompts = _prompts(body.get("prompt"))
        base = _request_id(body, "completion", header_id)
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

    async def _video_hash(self, part: ImagePart, data: bytes) -> str:
        """vLLM's mm_hash of a video: over its bytes and its loader's metadata (the header is
        probed and the frames sampled as vLLM does; the frames decoded only when vLLM hashes them
        instead of the bytes)."""
        if len(data) > self.limits.max_video_bytes:
            raise ApiError(
                f"a video of {len(data)} bytes is above the limit of "
                f"{self.limits.max_video_bytes} bytes",
                param="video_url",
            )
        if part.uuid is not None:  # even "": vLLM keys the item by whatever the client sent
            return part.uuid
        try:
            info = await anyio.to_thread.run_sync(self.decoder.probe_video, data)
            indices = self.decoder.sample_video(info)
            frames = None
            if sampled_bytes(info, len(indices)) < len(data):
                frames = (
                    await anyio.to_thread.run_sync(_decode_sampled, data, info, indices)
                ).frames
        except AiommError as exc:
            raise from_aiomm_error(exc) from exc
        # megabytes of blake3 (and the frames' bytes): off the event loop
        return await anyio.to_thread.run_sync(
            video_mm_hash,
            data,
            self.model_id,
            hash_metadata(info, indices, self.video_loader),
            frames,
        )

    async def _features(
        self,
        images: list[ImagePart],
        videos: list[ImagePart],
        prompt_ids: list[int],
        *,
        tensors: bool,
    ) -> tuple[dict[str, Any], list[int], int, dict[str, float]]:
        parts = [*images, *videos]
        n, n_images = len(parts), len(images)
        data: list[bytes] = [b""] * n
        hashes: list[str] = [""] * n

        async def load(i: int) -> None:
            data[i] = await self._media_bytes(parts[i])
            if i < n_images:
                uuid = parts[i].uuid
                hashes[i] = uuid if uuid is not None else await self._mm_hash(data[i])
            else:
                hashes[i] = await self._video_hash(parts[i], data[i])

        if n == 1:
            await load(0)
        else:
            try:
                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(load, i)
            except BaseExceptionGroup as group:  # one bad item is the request's 4xx, not a group
                raise first_error(group, ApiError) from None
        request = Request(
            prompt_token_ids=prompt_ids,
            images=data[:n_images],
            image_hashes=hashes[:n_images],
            videos=data[n_images:],  # sampled by VllmDecoder.sample_video, as vLLM's loader
        )
        try:
            result = await self.engine.process(request)
        except AiommError as exc:
            raise from_aiomm_error(exc) from exc
        hits = sum(1 for c in result.cache if c.value == "hit")
        by_modality = {"image": hashes[:n_images], "video": hashes[n_images:]}
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
            _place_payload(feats, result.items, kwargs_data, metadata)
        return feats, result.prompt_token_ids, hits, result.timings


#: ``chat_template_kwargs`` keys vLLM refuses
_TEMPLATE_KWARGS_REFUSED = frozenset({"chat_template", "tokenize"})
#: per API: the parse context's default ``tool_choice`` ("" for null; None: no parse context)
_TOOL_CHOICE: dict[str, str | None] = {"chat": "none", "messages": "", "responses": None}
#: per API: the prefix of a request id (a Responses body's own id is taken as it is)
_ID_PREFIX = {"chat": "chatcmpl-", "messages": "chatcmpl-", "completion": "cmpl-", "responses": ""}
#: chat-template kwargs the request's own fields set
_TEMPLATE_FLAGS = frozenset({"add_generation_prompt", "continue_final_message"})
#: request fields that change vLLM's rendering in ways aiomm does not reproduce, with the value
#: that leaves them out, and why
_UNREPRODUCED: dict[str, tuple[Any, str]] = {
    "tools": (None, "tool definitions are not rendered into the prompt"),
    "chat_template": (
        None,
        "a request's own chat template is refused (as vLLM refuses it "
        "without --trust-request-chat-template)",
    ),
    "mm_processor_kwargs": (
        {},  # vLLM refuses only a non-empty one
        "per-request processor kwargs are refused (as vLLM refuses them by default)",
    ),
    "use_beam_search": (False, "Beam search is not supported by the render endpoint"),
    "structured_outputs": (None, "structured outputs are not rendered"),
    "logprob_token_ids": (None, "logprob_token_ids are not rendered"),
    "suffix": (None, "fill-in-the-middle completions are not rendered"),
    "prompt_embeds": (None, "prompt embeddings are not taken"),
    "watermarking": (None, "watermarking is not rendered"),
    "repetition_detection": (None, "repetition detection is not rendered"),
    "routed_experts_prompt_start": (0, "routed_experts_prompt_start is not rendered"),
    "return_token_offsets": (False, "token offsets are not rendered"),
    "output_config": ({}, "output_config is not rendered"),  # an empty one changes nothing
}
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})


def refuse_unreproduced(body: Mapping[str, Any], api: str = "chat") -> None:
    """Refuse a request to ``api`` that sets a field whose effect on vLLM's response aiomm does
    not reproduce, or that vLLM refuses: a 400 naming it, never a response that silently
    differs from vLLM's.

    :raises ApiError: 400 naming the field.
    """
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):  # checked with or without a cut
        raise ApiError("'truncation_side' must be 'left' or 'right'", param="truncation_side")
    for key, (unset, why) in _UNREPRODUCED.items():
        value = body.get(key)
        if value is not None and value != unset and value != []:
            raise ApiError(f"'{key}' is not supported: {why}", param=key)
    if api == "messages":
        if body.get("max_tokens") is None:
            raise ApiError("'max_tokens' is required", param="max_tokens")
        thinking = body.get("thinking")
        if thinking is not None and not (
            isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        ):  # "disabled" sets a reasoning effort vLLM probes the template for
            raise ApiError(
                "'thinking' is not supported unless enabled or adaptive", param="thinking"
            )
    choice = body.get("tool_choice") if api in ("chat", "messages") else None
    if choice is not None and choice != "none" and not _anthropic_choice_none(choice):
        raise ApiError(  # vLLM's words: tools themselves are refused above
            "When using `tool_choice`, `tools` must be set.", param="tool_choice"
        )
    text = body.get("text") if api == "responses" else None
    text_format = text.get("format") if isinstance(text, dict) else None
    if text is not None and (
        not isinstance(text, dict)
        or (
            text_format is not None
            and (not isinstance(text_format, dict) or text_format.get("type") != "text")
        )
    ):
        raise ApiError(
            "'text.format' other than text is not supported: structured outputs are not rendered",
            param="text",
        )
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise ApiError(
            "'response_format' other than text is not supported: structured outputs are not "
            "rendered",
            param="response_format",
        )


def truncated(ids: list[int], body: Mapping[str, Any], max_model_len: int) -> list[int]:
    """``ids`` cut to the request's ``truncate_prompt_tokens`` as vLLM cuts a prompt: its last
    tokens kept (``truncation_side: "right"``: its first), ``-1`` the most the context takes
    with room for one output token.

    :raises ApiError: a size above the context, or a cut that leaves no token.
    """
    cut = _truncation(len(ids), body, max_model_len)
    return ids if cut is None else ids[cut]


def truncated_expanded(
    ids: list[int], features: dict[str, Any], body: Mapping[str, Any], max_model_len: int
) -> list[int]:
    """``ids`` with their placeholders expanded, cut again to ``truncate_prompt_tokens`` as vLLM's
    ``_truncate_expanded_prompt`` cuts them: every placeholder range must survive whole, and
    ``features``' ranges are moved (in place) with a cut from the left.

    :raises ApiError: a cut that would split or drop an item.
    """
    cut = _truncation(len(ids), body, max_model_len)
    if cut is None:
        return ids
    start, stop, _ = cut.indices(len(ids))
    placeholders = features["mm_placeholders"]
    for modality, ranges in placeholders.items():
        for r in ranges:
            end = r["offset"] + r["length"]
            if r["offset"] < start or end > stop:
                raise ApiError(
                    f"truncate_prompt_tokens={body['truncate_prompt_tokens']} would split or drop "
                    f"a(n) {modality} item, which spans tokens {r['offset']} to {end} of the "
                    f"{len(ids)}-token prompt. Multimodal placeholders expand after truncation "
                    "is applied, so the limit must leave every multimodal item intact. Please "
                    "raise truncate_prompt_tokens or shorten the multimodal input.",
                    param="truncate_prompt_tokens",
                )  # vLLM's words
    for ranges in placeholders.values():
        for r in ranges:
            r["offset"] -= start
    return ids[cut]


def _truncation(length: int, body: Mapping[str, Any], max_model_len: int) -> slice | None:
    """The slice ``truncate_prompt_tokens`` keeps of ``length`` tokens; None: all of them."""
    limit = body.get("truncate_prompt_tokens")
    if limit is None:
        return None
    limit = lax_int(limit, "truncate_prompt_tokens", lo=-1)
    if limit > max_model_len:
        raise ApiError(
            f"truncate_prompt_tokens={limit} cannot be greater than max_model_len={max_model_len}",
            param="truncate_prompt_tokens",
        )
    if limit == -1:
        limit = max_model_len - 1
    if limit == 0:
        raise ApiError("No token_ids rendered", param="truncate_prompt_tokens")  # vLLM's words
    if length <= limit:
        return None
    return slice(-limit, None) if body.get("truncation_side") != "right" else slice(0, limit)


def _template_extras(body: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """What vLLM adds to a request's chat-template kwargs: ``documents``, ``reasoning_effort``
    and, with an effort, ``enable_thinking`` unless the request set it."""
    extras: dict[str, Any] = {}
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list):
            raise ApiError("'documents' must be a list", param="documents")
        extras["documents"] = documents
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _REASONING_EFFORTS:
            raise ApiError(
                f"'reasoning_effort' must be one of {sorted(_REASONING_EFFORTS)}",
                param="reasoning_effort",
            )
        extras["reasoning_effort"] = effort
        if "enable_thinking" not in user:
            extras["enable_thinking"] = effort != "none"
    return extras


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completion request's prompts: a string, token ids, or a list of either.

    :raises ApiError: any other shape, an empty one, or a token id below 0.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' must be non-empty", param="prompt")
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("'prompt' must be a string, a list of strings or token ids", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [[lax_int(t, "prompt", lo=0) for t in p] for p in prompt]
    return [[lax_int(t, "prompt", lo=0) for t in prompt]]


def _request_id(body: Mapping[str, Any], api: str, header_id: str | None = None) -> str:
    """vLLM's request id: the API's prefix and the client's id (an ``X-Request-Id`` header, else
    the body's ``request_id``, even an empty one), else a random one. Responses take the
    body's id as it is, and no header."""
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise ApiError("'request_id' must be a string", param="request_id")
    if header_id is not None and api != "responses":
        rid = header_id
    if rid is None:
        return f"{_ID_PREFIX[api] or 'resp_'}{random_hex(8)}"
    return _ID_PREFIX[api] + rid


def _tool_choice(body: Mapping[str, Any], default: str, api: str) -> str | None:
    if api == "messages":  # vLLM's Anthropic mapping of the one choice it takes untooled
        return "none" if _anthropic_choice_none(body.get("tool_choice")) else None
    if "tool_choice" in body and body["tool_choice"] is None:
        return None  # an explicit null stays null
    return default or None


def _anthropic_choice_none(choice: Any) -> bool:
    return isinstance(choice, dict) and choice.get("type") == "none"


def _parallel_tool_calls(body: Mapping[str, Any], api: str) -> bool | None:
    if api == "messages" and isinstance(choice := body.get("tool_choice"), dict):
        # vLLM's Anthropic mapping: a tool choice carries whether calls may run in parallel
        return not lax_bool(
            choice.get("disable_parallel_tool_use") or False, "disable_parallel_tool_use"
        )
    if api != "chat" or "parallel_tool_calls" not in body:
        return True
    value = body["parallel_tool_calls"]
    return None if value is None else lax_bool(value, "parallel_tool_calls")


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


def _decode_sampled(data: bytes, info: VideoInfo, indices: list[int]) -> Any:
    return decode_video(data, lambda _: indices, info=info)


def vllm_mm_hash(data: bytes, model_id: str) -> str:
    """vLLM's mm_hash of an image given as encoded ``data`` to a server of ``model_id``.

    :raises DecodeError: ``data`` is not a recognised image.
    """
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            converted = converts_mode(image)
    except Exception as exc:
        raise DecodeError(
            f"not a recognised image ({len(data)} bytes): {type(exc).__name__}"
        ) from exc
    return image_mm_hash(data, model_id, mode_converted=converted)


def generate_request_features(
    result: Result,
    hashes: Sequence[str] | Mapping[str, Sequence[str]],
    *,
    wire: WireForm | None = None,
    tensors: bool = True,
    float_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest.features`` of an engine result made with
    ``EngineConfig(return_items=True)``: ``hashes`` are the items' mm_hashes (:func:`vllm_mm_hash`
    or the client's; a sequence for images, or a mapping per modality), ``tensors=False`` leaves
    the payload out, ``wire`` and ``float_dtype`` as :func:`encode_items` (``wire``: the
    model's, :meth:`WireForm.of` its processor). JSON-ready (plain strings)."""
    per_modality = {"image": hashes} if not isinstance(hashes, Mapping) else hashes
    per_modality = {m: list(h) for m, h in per_modality.items() if h}
    features: dict[str, Any] = {
        "mm_hashes": per_modality,
        "mm_placeholders": {
            m: [{"offset": r.offset, "length": r.length} for r in result.mm_placeholders.get(m, [])]
            for m in per_modality
        },
        "kwargs_data": None,
        "mm_metadata": None,
    }
    if tensors:
        kwargs_data, metadata = encode_items(
            result.items, wire or WireForm(), float_dtype=float_dtype
        )
        _place_payload(
            features,
            result.items,
            [str(k) for k in kwargs_data],
            [None if m is None else str(m) for m in metadata],
        )
    return features


def _place_payload(
    features: dict[str, Any],
    items: Sequence[MultiModalKwargsItem],
    kwargs_data: Sequence[Any],
    metadata: Sequence[Any],
) -> None:
    """``features``' ``kwargs_data`` and ``mm_metadata`` per modality, as vLLM writes them: a
    modality whose items have no metadata is left out of ``mm_metadata``, which is null when
    none has any."""
    features["kwargs_data"], features["mm_metadata"] = {}, {}
    for modality in features["mm_hashes"]:
        picked = [i for i, item in enumerate(items) if item.modality == modality]
        features["kwargs_data"][modality] = [kwargs_data[i] for i in picked]
        if any(metadata[i] is not None for i in picked):
            features["mm_metadata"][modality] = [metadata[i] for i in picked]
    features["mm_metadata"] = features["mm_metadata"] or None


def generate_request(
    token_ids: list[int],
    features: dict[str, Any] | None,
    *,
    model: str | None,
    sampling_params: dict[str, Any],
    request_id: str | None = None,
    parse_context: dict[str, Any] | None = None,
    body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``GenerateRequest`` body for ``/inference/v1/generate`` (``vllm serve --tokens-only``),
    with vLLM 0.33's top-level keys; ``body`` is the client request it renders (stream, cache
    salt, priority and KV-transfer options come from it).

    :raises ApiError: the body's ``stream`` or ``priority`` of the wrong type.
    """
    body = body or {}
    stream = flag(body, "stream", False)
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ApiError("'cache_salt' must be a non-empty string if given", param="cache_salt")
    if salt is not None and (len(salt) > 128 or any(c in salt for c in "@/\\\0")):
        # vLLM's rule: a salt names cache entries, in keys that these characters delimit
        raise ApiError(
            "'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\' "
            "or NUL",
            param="cache_salt",
        )
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise ApiError("'kv_transfer_params' must be an object", param="kv_transfer_params")
    return_ids = body.get("return_token_ids")
    ec_params = body.get("ec_transfer_params")
    if ec_params is not None and not isinstance(ec_params, dict):
        raise ApiError("'ec_transfer_params' must be an object", param="ec_transfer_params")
    return {
        "request_id": request_id or f"aiomm-{random_hex(8)}",
        "token_ids": token_ids,
        "token_offsets": None,
        "features": features,
        "content_parts": None,
        "sampling_params": sampling_params,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None
        if return_ids is None
        else lax_bool(return_ids, "return_token_ids"),
        "output_mode": "tokens",
        "parse_context": parse_context,
        "stream": stream,
        "stream_options": _stream_options(body.get("stream_options"), stream),
        "cache_salt": salt,
        "priority": 0 if body.get("priority") is None else lax_int(body["priority"], "priority"),
        "kv_transfer_params": kv_params or None,  # vLLM hoists only a non-empty one
        "ec_transfer_params": ec_params or None,
    }


def _stream_options(value: Any, stream: bool) -> dict[str, bool | None] | None:
    """vLLM's ``StreamOptions`` of a request, both flags written (an explicit null kept);
    non-empty ones only with ``stream``, and none at all without it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    if value and not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`", param="stream_options"
        )
    if not stream:
        return None
    return {key: _nullable_flag(value, key) for key in ("include_usage", "continuous_usage_stats")}


def _nullable_flag(value: Mapping[str, Any], key: str) -> bool | None:
    if key in value and value[key] is None:
        return None
    return flag(value, key, False)


def _wire_value(key: str, item: MultiModalKwargsItem, float_dtype: torch.dtype | None) -> Any:
    """``item[key]`` as vLLM's item holds it (repeated rows as a view the codec expands)."""
    value = item.data[key]
    config = item.fields[key]
    # dtype attributes and numpy views, not torch calls: each torch call releases the GIL
    # (aiomm.processing.image_ops' module docstring), and this runs once per item and response
    if (
        float_dtype is not None
        and isinstance(value, torch.Tensor)
        and value.dtype.is_floating_point
        and value.dtype != float_dtype
    ):
        value = value.to(float_dtype)  # as vLLM's processor output (BatchFeature's rule)
    if isinstance(value, torch.Tensor) and config.repeat is not None:
        # the layout is the field's (Repeat.expand_array); the codec writes it blockwise. numpy
        # has no bfloat16: its words go as int16, the bytes are the same
        raw = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
        if numpy_copyable(raw):
            name = str(value.dtype).removeprefix("torch.")
            return WireRows(config.repeat.expand_array(raw.numpy()), name)
        return config.repeat.expand(value).reshape(value.shape[0], -1)
    return value


def _field(key: str, config: Any, slices: list[Any]) -> Field:
    keep = key in _KEEP_ON_CPU
    if isinstance(config, PaddedImageField):
        # an item holds its own unpadded image: vLLM's processors unpad (Mistral 3, Pixtral)
        # and batch them
        return Field("batched", {"keep_on_cpu": keep})
    kind = config.kind if isinstance(config, MultiModalFieldConfig) else FieldKind.FLAT
    if kind is FieldKind.BATCHED:
        return Field("batched", {"keep_on_cpu": keep})
    if kind is FieldKind.SHARED:
        return Field("shared", {"keep_on_cpu": keep, "batch_size": config.batch_size})
    return Field("flat", {"keep_on_cpu": keep, "slices": slices, "dim": 0})


def encode_items(
    items: Sequence[MultiModalKwargsItem],
    wire: WireForm,
    *,
    float_dtype: torch.dtype | None = None,
    lazy: bool = False,
) -> tuple[list[PiecesString], list[PiecesString | None]]:
    """vLLM's ``kwargs_data`` and ``mm_metadata`` strings of a request's items, each as the
    base64 pieces the response writer sends without joining them (CPU work: call it in a
    worker thread); an item's metadata is None when it has no field kept on the CPU. ``wire``:
    the model's :class:`WireForm`. ``float_dtype``: floating-point tensors are cast to it
    (vLLM's model dtype). ``lazy``: ``kwargs_data``'s pieces are made as they are read
    (:class:`~.kwargs_codec.ItemB64`, from the items' tensors, which must stay unchanged).

    A flat field's slices describe the whole batch its item was processed in (every item of
    the batch carries all of them, as vLLM's do): the request's images are one batch; its
    videos too, or each its own with ``wire.per_video_slices`` (recorded from vLLM: two Qwen3-VL
    videos each carry ``[[[0, rows, None]]]``, two images ``[[[0, a, None]], [[a, b, None]]]``).
    """
    batches: list[list[int]] = [[], []]  # images and others, videos
    for i, item in enumerate(items):
        if wire.per_video_slices and item.modality == "video":
            batches.append([i])
        else:
            batches[item.modality == "video"].append(i)
    slices: list[dict[str, list[Any]]] = [{}] * len(items)
    batch_sizes = [0] * len(items)
    for batch in batches:
        batch_slices = _flat_slices([items[i] for i in batch])
        for i in batch:
            slices[i], batch_sizes[i] = batch_slices, len(batch)
    kwargs_data: list[PiecesString] = []
    metadata: list[PiecesString | None] = []
    for item, item_slices, batch_size in zip(items, slices, batch_sizes, strict=True):
        keys = [k for k in item.data if k not in wire.dropped_keys]
        names = {k: wire.renamed_keys.get(k, k) for k in keys}
        values = {names[k]: _wire_value(k, item, float_dtype) for k in keys}
        fields = {names[k]: _field(names[k], item.fields[k], item_slices.get(k, [])) for k in keys}
        if wire.image_token_id is not None and item.modality == "image":
            values["image_token_id"] = torch.tensor(wire.image_token_id)
            fields["image_token_id"] = Field(
                "shared", {"keep_on_cpu": True, "batch_size": batch_size}
            )
        seconds = item.prompt_data.get("timestamps")
        if seconds is not None and wire.timestamps_field:
            # Qwen3-VL: vLLM's video item carries its prompt's timestamps (a batched field)
            values["timestamps"] = [float(s) for s in seconds]
            fields["timestamps"] = Field("batched", {"keep_on_cpu": True})
        entries = {k: (values[k], fields[k]) for k in _ordered(values)}
        kwargs_data.append(
            PiecesString(encode_item_lazy(entries) if lazy else encode_item_pieces(entries))
        )
        meta = {k: e for k, e in entries.items() if k in _KEEP_ON_CPU}
        metadata.append(PiecesString(encode_item_pieces(meta)) if meta else None)
    return kwargs_data, metadata


def _flat_slices(items: Sequence[MultiModalKwargsItem]) -> dict[str, list[Any]]:
    """Per flat key, the slices of one batch's items that have it (an image has no video
    keys), in vLLM's nested form ``[[start, stop, None]]`` per item."""
    slices: dict[str, list[Any]] = {}
    starts: dict[str, int] = {}
    for item in items:
        for key, value in item.data.items():
            config = item.fields[key]
            if isinstance(config, MultiModalFieldConfig) and config.kind is not FieldKind.FLAT:
                continue
            rows = int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else 1
            start = starts.get(key, 0)
            slices.setdefault(key, []).append([[start, start + rows, None]])
            starts[key] = start + rows
    return slices


def _ordered(keys: Any) -> list[str]:
    first = [k for k in _KEY_ORDER if k in keys]
    return first + [k for k in keys if k not in first]
