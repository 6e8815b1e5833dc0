"""A stand-in for ``vllm serve MODEL --tokens-only``: the gateway's upstream without a GPU.

``aiomm standin MODEL --port 8001`` (or ``python -m aiomm.server.standin MODEL --port 8001``)
serves ``POST /inference/v1/generate``, ``GET /health`` and ``GET /v1/models`` on loopback for
a model folder or a registered short name. Every ``GenerateRequest`` it receives is checked
as vLLM 0.33 checks it, with the model's own facts read from the folder (its tokenizer, the
image and video token ids of its ``config.json``, its context length, its vision merge size):

- the body's keys (``token_ids`` and ``sampling_params`` required, unknown keys refused) and
  their types;
- ``token_ids``: a non-empty list of ints inside the vocabulary, within the context length
  with ``max_tokens``;
- ``sampling_params``: known keys only, each of its type and in vLLM's range;
- ``features``: as many ``mm_hashes`` as placeholders per modality, ranges in order inside
  ``token_ids``, each image range holding the model's image token, every image token inside a
  range, a Qwen-style grid giving as many tokens as its range holds, and decodable items.

A valid request is answered with words of the model's tokenizer chosen by a hash of the prompt
(``token_ids`` and ``mm_hashes``: the same request, the same answer), then the end-of-sequence
token, cut at ``max_tokens``; streamed as vLLM streams (``output_kind`` deltas, cumulative or
final only; with ``stream_options.include_usage`` a last chunk with no choices holding the
usage, and with ``continuous_usage_stats`` the usage so far on every chunk). An invalid one gets
vLLM's 400 error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiomm.tracing import attached, extract_context, span, tracing_enabled

__all__ = ("ModelSpec", "StandIn", "answer", "create_standin_app", "main", "run", "validate")

#: GenerateRequest's keys (vLLM 0.33) and the types each takes; ``None`` is always allowed
#: except for the required ones
TOP_LEVEL: dict[str, type | tuple[type, ...]] = {
    "request_id": str,
    "token_ids": list,
    "token_offsets": list,
    "features": dict,
    "content_parts": list,
    "sampling_params": dict,
    "model": str,
    "reasoning_ended": bool,
    "reasoning_parser_kwargs": dict,
    "return_token_ids": bool,
    "output_mode": str,
    "parse_context": dict,
    "stream": bool,
    "stream_options": dict,
    "cache_salt": str,
    "priority": int,
    "kv_transfer_params": dict,
    "ec_transfer_params": dict,
}
REQUIRED = ("token_ids", "sampling_params")
#: SamplingParams' keys and their types (a float key takes an int, as pydantic does)
SAMPLING: dict[str, type] = {
    "n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "stop": list,
    "stop_token_ids": list,
    "ignore_eos": bool,
    "max_tokens": int,
    "min_tokens": int,
    "logprobs": int,
    "prompt_logprobs": int,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "include_stop_str_in_output": bool,
    "output_kind": int,
    "stream_interval": int,
    "skip_clone": bool,
    "output_text_buffer_length": int,
    "logit_bias": dict,
    "allowed_token_ids": list,
    "extra_args": dict,
    "bad_words": list,
    "skip_reading_prefix_cache": bool,
    "thinking_token_budget": int,
}
#: vLLM's RequestOutputKind: each chunk all tokens so far, only the new ones, or one at the end
CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2
FEATURE_KEYS = frozenset({"mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"})
#: an item's grid key per modality (Qwen and GLM layouts)
GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}
#: words an answer is made of (those the tokenizer knows without an unknown token)
WORDS = (
    "a photo of the picture image shapes colours in and detail at is about look small large "
    "red blue green cat dog tree house sky light dark with on bright soft"
).split()


class Invalid(Exception):
    """One reason a request is refused; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class ModelSpec:
    """What the stand-in knows of its model: read from a folder by :meth:`from_folder`."""

    name: str
    #: ids are valid below this (vLLM: the larger of the tokenizer's and the config's vocab)
    vocab_size: int
    max_model_len: int = 32768
    image_token_id: int | None = None
    video_token_id: int | None = None
    #: the vision encoder's spatial merge (a Qwen-style grid gives t*h*w / merge**2 tokens)
    merge_size: int | None = None
    eos_token_id: int | None = None
    #: the answer's words, each as its token ids
    words: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_folder(cls, folder: Path, name: str | None = None) -> ModelSpec:
        from transformers import AutoTokenizer

        config = json.loads((folder / "config.json").read_text())
        # Qwen2.5-Omni: the thinker's config is the model the render serves
        config = config.get("thinker_config") or config
        text = config.get("text_config") or config.get("llm_config") or {}
        vision = config.get("vision_config") or {}

        def first(*keys: str, within: Sequence[dict[str, Any]] = (config, text)) -> Any:
            for part in within:
                for key in keys:
                    if isinstance(part.get(key), int) and not isinstance(part[key], bool):
                        return part[key]
            return None

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        vocab = max(len(tokenizer), first("vocab_size") or 0)
        unk = tokenizer.unk_token_id
        words = []
        for i, word in enumerate(WORDS):
            ids = tokenizer.encode(word if i == 0 else " " + word, add_special_tokens=False)
            if ids and unk not in ids:
                words.append([int(t) for t in ids])
        if not words:  # a vocabulary with none of them: its first plain tokens
            special = set(tokenizer.all_special_ids)
            plain = [i for i in range(len(tokenizer)) if i not in special][:16]
            words = [[i] for i in plain]
        eos = tokenizer.eos_token_id
        if eos is None:
            found = first("eos_token_id")
            eos = found if isinstance(found, int) else None
        return cls(
            name=name or str(folder),
            vocab_size=vocab,
            max_model_len=first("max_position_embeddings", "max_sequence_length") or 32768,
            image_token_id=first("image_token_id", "image_token_index", "img_context_token_id"),
            video_token_id=first("video_token_id", "video_token_index"),
            merge_size=first("spatial_merge_size", within=(vision,)),
            eos_token_id=eos,
            words=words,
        )


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """``value`` is of ``kind`` as pydantic reads JSON: a bool is no int, an int is a float."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if float in kinds and isinstance(value, int):
        return True
    return isinstance(value, kinds)


def validate(body: Any, spec: ModelSpec) -> list[str]:
    """Every reason vLLM would refuse ``body`` for ``spec``'s model (empty when it is valid)."""
    return [e.message for e in _problems(body, spec)]


def _problems(body: Any, spec: ModelSpec) -> list[Invalid]:
    if not isinstance(body, dict):
        return [Invalid("the body is not a JSON object")]
    errors: list[Invalid] = []
    for key in sorted(set(body) - set(TOP_LEVEL)):
        errors.append(Invalid(f"Extra inputs are not permitted: {key}", key))
    for key in REQUIRED:
        if body.get(key) is None:
            errors.append(Invalid(f"Field required: {key}", key))
    for key, kind in TOP_LEVEL.items():
        value = body.get(key)
        if value is not None and not _is(value, kind):
            errors.append(Invalid(f"{key}: {type(value).__name__} is not a {kind}", key))
    if errors:
        return errors
    ids = body["token_ids"]
    if not ids:
        errors.append(Invalid("token_ids: List should have at least 1 item", "token_ids"))
    elif not all(_is(t, int) for t in ids):
        errors.append(Invalid("token_ids: every token id must be an int", "token_ids"))
    elif min(ids) < 0:
        errors.append(Invalid("token_ids must not contain negative values", "token_ids"))
    elif max(ids) >= spec.vocab_size:
        errors.append(Invalid(f"Token id {max(ids)} is out of vocabulary", "token_ids"))
    if body.get("output_mode") not in (None, "tokens"):
        errors.append(Invalid("output_mode: this engine answers 'tokens'", "output_mode"))
    if body.get("priority") not in (None, 0):
        errors.append(Invalid("Priority scheduling is not enabled on the served model", "priority"))
    options = body.get("stream_options")
    if options is not None:
        for key, value in options.items():
            if key not in ("include_usage", "continuous_usage_stats"):
                errors.append(Invalid(f"stream_options: unknown key {key}", "stream_options"))
            elif value is not None and not isinstance(value, bool):
                errors.append(Invalid(f"stream_options.{key} must be a bool", "stream_options"))
    errors.extend(_sampling_problems(body["sampling_params"], len(ids), spec))
    if errors:
        return errors
    features = body.get("features")
    if features is not None:
        errors.extend(_feature_problems(features, ids, spec))
    return errors


def _sampling_problems(sp: dict[str, Any], prompt_len: int, spec: ModelSpec) -> list[Invalid]:
    errors: list[Invalid] = []
    for key, value in sp.items():
        kind = SAMPLING.get(key)
        if kind is None:
            errors.append(Invalid(f"sampling_params: unknown parameter {key}", key))
        elif value is not None and not _is(value, kind):
            errors.append(Invalid(f"sampling_params.{key}: {value!r} is not a {kind}", key))
    if errors:
        return errors

    def check(key: str, ok: Any, why: str) -> None:
        value = sp.get(key)
        if value is not None and not ok(value):
            errors.append(Invalid(f"{key} must be {why}, got {value!r}.", key))

    check("n", lambda v: v >= 1, "at least 1")
    check("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
    check("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
    check("repetition_penalty", lambda v: v > 0, "greater than zero")
    check("temperature", lambda v: v >= 0, "non-negative")
    check("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    check("top_k", lambda v: v == -1 or v >= 0, "0 (disable), or at least 1")
    check("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
    check("max_tokens", lambda v: v >= 1, "at least 1")
    check("min_tokens", lambda v: v >= 0, "greater than or equal to 0")
    check("logprobs", lambda v: v >= -1, "non-negative or -1")
    check("prompt_logprobs", lambda v: v >= -1, "non-negative or -1")
    check("output_kind", lambda v: v in (CUMULATIVE, DELTA, FINAL_ONLY), "0, 1 or 2")
    check("stream_interval", lambda v: v >= 1, "at least 1")
    check("stop", lambda v: all(isinstance(s, str) for s in v), "a list of strings")
    check("bad_words", lambda v: all(isinstance(s, str) for s in v), "a list of strings")
    for key in ("stop_token_ids", "allowed_token_ids"):
        check(
            key,
            lambda v: all(_is(t, int) and 0 <= t < spec.vocab_size for t in v),
            "token ids inside the vocabulary",
        )
    check("allowed_token_ids", lambda v: len(v) > 0, "a non-empty list")
    max_tokens, min_tokens = sp.get("max_tokens"), sp.get("min_tokens")
    if isinstance(max_tokens, int) and isinstance(min_tokens, int) and min_tokens > max_tokens:
        errors.append(
            Invalid(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {min_tokens}.",
                "min_tokens",
            )
        )
    wanted = prompt_len + (max_tokens if isinstance(max_tokens, int) else 0)
    if prompt_len >= spec.max_model_len or wanted > spec.max_model_len:
        errors.append(
            Invalid(
                f"This model's maximum context length is {spec.max_model_len} tokens. However, "
                f"you requested {wanted} tokens ({prompt_len} in the messages, "
                f"{max_tokens or 0} in the completion).",
                "max_tokens",
            )
        )
    return errors


def _feature_problems(feats: dict[str, Any], ids: list[int], spec: ModelSpec) -> list[Invalid]:
    errors: list[Invalid] = []
    # vLLM's one modality for a model's images and videos (Kimi-K2.5's images): checked as images
    feats = {
        key: {"image" if m == "vision_chunk" else m: v for m, v in value.items()}
        if key in FEATURE_KEYS and isinstance(value, dict)
        else value
        for key, value in feats.items()
    }
    unknown = set(feats) - FEATURE_KEYS
    if unknown:
        return [Invalid(f"features: Extra inputs are not permitted: {sorted(unknown)}", "features")]
    hashes, ranges = feats.get("mm_hashes"), feats.get("mm_placeholders")
    if not isinstance(hashes, dict) or not isinstance(ranges, dict):
        return [Invalid("features: mm_hashes and mm_placeholders are required objects", "features")]
    if set(hashes) != set(ranges):
        errors.append(Invalid("features: mm_hashes and mm_placeholders name other modalities"))
    covered = [False] * len(ids)
    spans: list[tuple[int, int]] = []
    for modality, items in ranges.items():
        token = spec.image_token_id if modality == "image" else spec.video_token_id
        if modality not in GRID_KEYS:
            errors.append(Invalid(f"features: the model takes no {modality!r} items", "features"))
            continue
        given = hashes.get(modality)
        if not isinstance(items, list) or not isinstance(given, list):
            errors.append(Invalid(f"features: {modality} must list its items", "features"))
            continue
        if len(given) != len(items):
            errors.append(
                Invalid(f"{modality}: {len(items)} placeholders but {len(given)} mm_hashes")
            )
        if not all(isinstance(h, str) and h for h in given):
            errors.append(Invalid(f"{modality}: every mm_hash must be a non-empty string"))
        for r in items:
            if not isinstance(r, dict) or not set(r) <= {"offset", "length", "is_embed"}:
                errors.append(Invalid(f"{modality}: bad placeholder {r}"))
                continue
            off, length = r.get("offset"), r.get("length")
            if (
                not (isinstance(off, int) and isinstance(length, int))
                or isinstance(off, bool)
                or isinstance(length, bool)
                or off < 0
                or length <= 0
            ):
                errors.append(Invalid(f"{modality}: bad placeholder {r}"))
                continue
            if off + length > len(ids):
                errors.append(Invalid(f"{modality}: placeholder {r} ends past the prompt"))
                continue
            spans.append((off, off + length))
            inside = ids[off : off + length]
            marks = {t for t in (token, spec.image_token_id) if t is not None}
            if marks and not marks & set(inside):
                errors.append(
                    Invalid(f"{modality}: placeholder {r} holds no {modality} token ({token})")
                )
            for i in range(off, off + length):
                covered[i] = True
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            errors.append(Invalid("features: placeholder ranges overlap"))
            break
    for modality, token in (("image", spec.image_token_id), ("video", spec.video_token_id)):
        if token is None:
            continue
        stray = sum(1 for t, c in zip(ids, covered, strict=True) if t == token and not c)
        if stray:
            errors.append(
                Invalid(
                    f"{stray} {modality} tokens ({token}) lie outside every placeholder: the "
                    "prompt's multimodal tokens do not match the items"
                )
            )
    if not errors:
        errors.extend(_item_problems(feats, ranges, ids, spec))
    return errors


def _item_problems(
    feats: dict[str, Any], ranges: dict[str, Any], ids: list[int], spec: ModelSpec
) -> list[Invalid]:
    from aiomm.vllm.wire import TensorValue, decode_item

    errors: list[Invalid] = []
    for part in ("kwargs_data", "mm_metadata"):
        data = feats.get(part)
        if data is None:
            continue
        if not isinstance(data, dict):
            errors.append(Invalid(f"features.{part} must be an object", "features"))
            continue
        for modality, items in ranges.items():
            encoded = data.get(modality) or []
            if len(encoded) != len(items):
                errors.append(Invalid(f"{part}: {len(encoded)} items for {len(items)} ranges"))
                continue
            for r, b64 in zip(items, encoded, strict=True):
                if b64 is None:  # to be resolved from the engine's cache
                    continue
                try:
                    item = decode_item(b64)
                except (ValueError, TypeError) as exc:
                    errors.append(Invalid(f"{part}: an item that does not decode: {exc}"))
                    continue
                grid = item.get(GRID_KEYS[modality], (None,))[0]
                token = spec.image_token_id if modality == "image" else spec.video_token_id
                if (
                    modality != "image"
                    or not isinstance(grid, TensorValue)
                    or not spec.merge_size
                    or token is None
                ):
                    continue
                t, h, w = (int(x) for x in grid.array().reshape(-1)[:3])
                want = t * h * w // spec.merge_size**2
                have = ids[r["offset"] : r["offset"] + r["length"]].count(token)
                if want != have:
                    errors.append(
                        Invalid(f"{part}: grid {t, h, w} gives {want} image tokens, range {have}")
                    )
    return errors


def answer(body: dict[str, Any], spec: ModelSpec) -> tuple[list[int], str]:
    """The generated ids for a valid ``body`` and the finish reason: words chosen by a hash of
    the prompt, then end of sequence; ``max_tokens`` cuts it (``"length"``)."""
    sp = body["sampling_params"]
    feats = body.get("features") or {}
    key = json.dumps([body["token_ids"], feats.get("mm_hashes")], separators=(",", ":"))
    digest = hashlib.blake2b(key.encode(), digest_size=32).digest()
    count = 4 + digest[0] % 8
    ids: list[int] = []
    for i in range(count):
        ids.extend(spec.words[digest[1 + i] % len(spec.words)])
    max_tokens = sp.get("max_tokens")
    if max_tokens is None:
        max_tokens = spec.max_model_len - len(body["token_ids"])
    min_tokens = sp.get("min_tokens") or 0
    i = count
    while len(ids) < min_tokens or (sp.get("ignore_eos") and len(ids) < max_tokens):
        ids.extend(spec.words[digest[(1 + i) % len(digest)] % len(spec.words)])
        i += 1
    stops = set(sp.get("stop_token_ids") or ())
    for n, token in enumerate(ids[:max_tokens]):
        if token in stops and n + 1 >= min_tokens:
            return ids[: n + 1], "stop"
    if not sp.get("ignore_eos") and spec.eos_token_id is not None:
        ids.append(spec.eos_token_id)
    if len(ids) > max_tokens:
        return ids[:max_tokens], "length"
    return ids, "stop" if not sp.get("ignore_eos") else "length"


class StandIn:
    """The stand-in's Starlette app for ``spec``'s model (``self.app``), and what it saw.

    ``api_key``: as ``vllm serve --api-key``: ``/inference/v1/generate`` and ``/v1/models``
    answer vLLM's 401 ``{"error":"Unauthorized"}`` unless the request carries
    ``Authorization: Bearer <api_key>``; ``/health`` stays open. ``delay_s``: a pause before
    each streamed chunk. ``script``: answer these ids (cut at ``max_tokens``) instead of hashed
    words. The valid bodies are kept in ``seen`` (the last ``keep`` of them), finished streams'
    request ids in ``completed``, abandoned ones' in ``abandoned``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        api_key: str | None = None,
        delay_s: float = 0.0,
        script: list[int] | None = None,
        keep: int = 64,
    ) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.spec = spec
        self.api_key = api_key
        self.delay_s = delay_s
        self.script = script
        self.keep = keep
        self.seen: list[dict[str, Any]] = []
        self.refused: list[list[str]] = []
        self.completed: list[str] = []
        self.abandoned: list[str] = []
        self.authorizations: list[str | None] = []
        self.health_probes = 0
        tracing_enabled()  # spans when the host configured OpenTelemetry
        self.app = Starlette(
            routes=[
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    def _authorized(self, request: Any) -> bool:
        given = request.headers.get("authorization")
        self.authorizations.append(given)
        return self.api_key is None or given == f"Bearer {self.api_key}"

    @staticmethod
    def _json(obj: Any, status: int = 200) -> Any:
        import orjson
        from starlette.responses import Response

        return Response(orjson.dumps(obj), status_code=status, media_type="application/json")

    def _unauthorized(self) -> Any:
        from starlette.responses import Response

        return Response(b'{"error":"Unauthorized"}', status_code=401, media_type="application/json")

    async def health(self, request: Any) -> Any:
        from starlette.responses import Response

        self.health_probes += 1
        self.authorizations.append(request.headers.get("authorization"))
        return Response(status_code=200)

    async def models(self, request: Any) -> Any:
        if not self._authorized(request):
            return self._unauthorized()
        model = {"id": self.spec.name, "object": "model", "created": 0, "owned_by": "vllm"}
        return self._json({"object": "list", "data": [model]})

    def _refuse(self, errors: list[Invalid]) -> Any:
        from aiomm.vllm.errors import ApiError

        self.refused.append([e.message for e in errors])
        message = "; ".join(e.message for e in errors)
        return self._json(ApiError(message, status=400, param=errors[0].param).body(), 400)

    async def generate(self, request: Any) -> Any:

        if not self._authorized(request):
            return self._unauthorized()
        # the gateway's trace goes on here, as a traced engine's would
        with attached(extract_context(request.headers)), span("aiomm.standin.generate"):
            return await self._generate(request)

    async def _generate(self, request: Any) -> Any:
        import anyio
        import orjson
        from starlette.responses import StreamingResponse

        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return self._refuse([Invalid(f"JSON decode error: {exc}")])
        errors = _problems(body, self.spec)
        if errors:
            return self._refuse(errors)
        self.seen = [*self.seen[-(self.keep - 1) :], body] if self.keep > 0 else []
        rid = body.get("request_id") or f"{uuid.uuid4().hex}"
        sp = body["sampling_params"]
        if self.script is not None:
            limit = sp.get("max_tokens") or len(self.script)
            ids = self.script[:limit]
            finish = "length" if len(ids) < len(self.script) else "stop"
        else:
            ids, finish = answer(body, self.spec)
        prompt = len(body["token_ids"])

        def usage(done: int) -> dict[str, Any]:
            return {
                "prompt_tokens": prompt,
                "total_tokens": prompt + done,
                "completion_tokens": done,
                "prompt_tokens_details": None,
            }

        if not body.get("stream"):
            choice = {"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": ids}
            out = {
                "request_id": rid,
                "output_mode": "tokens",
                "choices": [choice],
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
            return self._json(out)
        kind = sp.get("output_kind", DELTA)
        options = body.get("stream_options") or {}
        continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
        steps = [len(ids)] if kind == FINAL_ONLY or not ids else range(1, len(ids) + 1)

        async def events() -> AsyncIterator[bytes]:
            try:
                last = 0
                for end in steps:
                    await anyio.sleep(self.delay_s)
                    new = ids[last:end] if kind != CUMULATIVE else ids[:end]
                    choice = {
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": finish if end == len(ids) else None,
                        "token_ids": new,
                    }
                    chunk: dict[str, Any] = {
                        "request_id": rid,
                        "output_mode": "tokens",
                        "choices": [choice],
                    }
                    if continuous:  # the usage so far
                        chunk["usage"] = usage(end)
                    last = end
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if options.get("include_usage"):
                    # vLLM's last chunk: no choices, the whole request's usage
                    whole = {k: v for k, v in usage(len(ids)).items() if v is not None}
                    final: dict[str, Any] = {"request_id": rid, "choices": [], "usage": whole}
                    yield b"data: " + orjson.dumps(final) + b"\n\n"
                yield b"data: [DONE]\n\n"
                self.completed.append(rid)
            finally:
                if rid not in self.completed:
                    self.abandoned.append(rid)

        return StreamingResponse(events(), media_type="text/event-stream")


def create_standin_app(model: str, *, api_key: str | None = None) -> StandIn:
    """The :class:`StandIn` for ``model``: a model folder or a registered short name."""
    from aiomm.server.state import model_folder

    folder = model_folder(model)
    return StandIn(ModelSpec.from_folder(folder, name=model), api_key=api_key)


def run(model: str, host: str = "127.0.0.1", port: int = 8001) -> int:
    """Serve the stand-in for ``model`` on ``host:port`` until SIGINT or SIGTERM.

    :returns: 0 after a clean stop, 2 when ``model`` is unknown, 1 when the server could not
        start (the port is taken).
    """
    import uvicorn

    from aiomm.errors import AiommError

    started = time.monotonic()
    try:
        standin = create_standin_app(model)
    except AiommError as exc:
        print(f"aiomm standin: {model!r} is not a model folder nor a registered name: {exc}")
        return 2
    server = uvicorn.Server(
        uvicorn.Config(standin.app, host=host, port=port, log_level="warning", lifespan="off")
    )
    print(
        f"aiomm standin: {model} (vocab {standin.spec.vocab_size}, image token "
        f"{standin.spec.image_token_id}) on http://{host}:{port} after "
        f"{time.monotonic() - started:.1f} s",
        flush=True,
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        server.run()  # uvicorn stops on SIGINT and SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiomm.server.standin MODEL [--host H] [--port N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m aiomm.server.standin",
        description="A stand-in for `vllm serve MODEL --tokens-only` (no GPU, no weights).",
    )
    parser.add_argument("model", help="a model folder or a registered short name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    return run(args.model, host=args.host, port=args.port)


if __name__ == "__main__":
    sys.exit(main())
