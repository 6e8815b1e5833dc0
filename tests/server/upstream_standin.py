"""A loopback stand-in for ``vllm serve --tokens-only``'s ``/inference/v1/generate``.

It validates every field of the body against vLLM 0.33's ``GenerateRequest`` (types, lengths,
placeholder ranges inside ``token_ids``, decodable items whose rows fit their placeholders) and
answers scripted token ids, streamed one per SSE chunk when asked. It records what it saw and
whether a stream was abandoned by its client.

Kept for the gateway tests that script exact answers and check the gateway's own choices (every
key sent, ``output_kind`` for ``stream``); the packaged stand-in a user runs, with the model's
token ids read from its folder, is :mod:`aiomm.server.standin` (``tests/server/test_standin.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from aiomm.server import standin
from aiomm.vllm.wire import TensorValue, decode_item

TOP_LEVEL = {
    "request_id": str,
    "token_ids": list,
    "token_offsets": (list, type(None)),
    "features": (dict, type(None)),
    "content_parts": (list, type(None)),
    "sampling_params": dict,
    "model": (str, type(None)),
    "reasoning_ended": (bool, type(None)),
    "reasoning_parser_kwargs": (dict, type(None)),
    "return_token_ids": (bool, type(None)),
    "output_mode": str,
    "parse_context": (dict, type(None)),
    "stream": bool,
    "stream_options": (dict, type(None)),
    "cache_salt": (str, type(None)),
    "priority": int,
    "kv_transfer_params": (dict, type(None)),
    "ec_transfer_params": (dict, type(None)),
}
# SamplingParams' keys and their types: the packaged stand-in's table
SAMPLING = standin.SAMPLING
IMAGE_PAD = 151655
#: each modality's pad token, and its grid and pixel keys in an item
PADS = {"image": IMAGE_PAD, "video": 151656}
KEYS = {
    "image": ("image_grid_thw", "pixel_values"),
    "video": ("video_grid_thw", "pixel_values_videos"),
}


def validate(body: Any, *, image_token_id: int = IMAGE_PAD, runs: bool = True) -> list[str]:
    """Every way ``body`` breaks the protocol (empty when it is valid).

    A placeholder range must hold ``image_token_id``; with ``runs`` (Qwen's layout), nothing
    else. An item with ``image_grid_thw`` must give its range's length and pixel rows.
    """
    errors: list[str] = []
    if not isinstance(body, dict):
        return ["body is not an object"]
    if set(body) != set(TOP_LEVEL):
        errors.append(f"keys differ: {sorted(set(body) ^ set(TOP_LEVEL))}")
    for key, kind in TOP_LEVEL.items():
        if key in body and not isinstance(body[key], kind):
            errors.append(f"{key} has type {type(body[key]).__name__}")
    ids = body.get("token_ids") or []
    if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        errors.append("token_ids must be a non-empty list of non-negative ints")
    if body.get("output_mode") != "tokens":
        errors.append("output_mode must be 'tokens'")
    sp = body.get("sampling_params") or {}
    for key, value in sp.items():
        kind = SAMPLING.get(key)
        if kind is None:
            errors.append(f"unknown sampling param {key}")
        elif not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            errors.append(f"sampling param {key} has type {type(value).__name__}")
    if sp.get("max_tokens", 16) + len(ids) > 32768:
        errors.append("max_tokens + prompt above the context")
    if sp.get("output_kind") != (1 if body.get("stream") else 2):
        # vLLM streams what output_kind asks for: FINAL_ONLY (2) would stream one last chunk
        # where the gateway reads deltas (1)
        errors.append(f"output_kind {sp.get('output_kind')} for stream={body.get('stream')}")
    feats = body.get("features")
    if isinstance(feats, dict):
        errors.extend(_validate_features(feats, ids, image_token_id, runs))
    return errors


def _validate_features(
    feats: dict[str, Any], ids: list[int], image_token_id: int, runs: bool
) -> list[str]:
    errors: list[str] = []
    if set(feats) != {"mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"}:
        return [f"features keys {sorted(feats)}"]
    hashes, ranges = feats["mm_hashes"], feats["mm_placeholders"]
    if set(hashes) != set(ranges):
        errors.append("mm_hashes and mm_placeholders name different modalities")
    for modality, items in ranges.items():
        if len(items) != len(hashes.get(modality, [])):
            errors.append(f"{modality}: {len(items)} placeholders, different number of hashes")
        if not all(isinstance(h, str) and h for h in hashes.get(modality, [])):
            errors.append("mm_hashes must be non-empty strings")
        end = 0
        for r in items:
            off, length = r.get("offset"), r.get("length")
            if set(r) != {"offset", "length"} or not (
                isinstance(off, int) and isinstance(length, int) and off >= end and length > 0
            ):
                errors.append(f"bad placeholder {r}")
                continue
            # (Kimi-K2.5's images are vLLM's vision_chunk items)
            pad = image_token_id if modality in ("image", "vision_chunk") else PADS.get(modality)
            inside = ids[off : off + length]
            if off + length > len(ids) or pad not in inside:
                errors.append(f"placeholder {r} holds no {modality} token inside token_ids")
            elif runs and any(t != pad for t in inside):
                errors.append(f"placeholder {r} is not a run of {modality} pads inside token_ids")
            end = off + length
        for part in ("kwargs_data", "mm_metadata"):
            data = feats[part]
            if data is None:
                continue
            encoded = data.get(modality, [])
            if len(encoded) != len(items):
                errors.append(f"{part}: {len(encoded)} items for {len(items)} placeholders")
            for r, b64 in zip(items, encoded, strict=False):
                try:
                    item = decode_item(b64)
                except ValueError as exc:
                    errors.append(f"{part}: {exc}")
                    continue
                grid_key, pixels_key = KEYS.get(modality, KEYS["image"])
                if not runs and grid_key not in item:
                    if part == "kwargs_data" and not any(
                        isinstance(v, TensorValue) and v.data for v, _ in item.values()
                    ):
                        errors.append(f"{part}: an item without tensors")
                    continue
                grid = item.get(grid_key, (None,))[0]
                if not isinstance(grid, TensorValue):
                    errors.append(f"{part}: {grid_key} missing")
                    continue
                t, h, w = (int(x) for x in grid.array())
                if t * h * w // 4 != r["length"]:
                    errors.append(f"{part}: grid {t, h, w} does not give {r['length']} tokens")
                pixels = item.get(pixels_key, (None,))[0]
                if part == "kwargs_data" and (
                    not isinstance(pixels, TensorValue) or pixels.shape[0] != t * h * w
                ):
                    errors.append(f"kwargs_data: {pixels_key} rows differ from the grid")
    return errors


class StandIn:
    """The stand-in's app and what it recorded.

    ``api_key``: as ``vllm serve --api-key``, ``/inference/v1/generate`` then answers vLLM's
    401 ``{"error":"Unauthorized"}`` unless the request carries exactly
    ``Authorization: Bearer <api_key>``; ``/health`` stays open, as vLLM's. Every request's
    ``Authorization`` header (None when absent) is recorded in ``authorizations``, and each
    ``/health`` probe counted in ``health_probes``.
    """

    def __init__(
        self,
        script: list[int],
        *,
        delay_s: float = 0.0,
        image_token_id: int = IMAGE_PAD,
        runs: bool = True,
        api_key: str | None = None,
    ) -> None:
        self.script = script
        self.delay_s = delay_s
        self.image_token_id = image_token_id
        self.runs = runs
        self.api_key = api_key
        self.seen: list[dict[str, Any]] = []
        self.completed: list[str] = []
        self.abandoned: list[str] = []
        self.authorizations: list[str | None] = []
        self.health_probes = 0
        self.app = Starlette(
            routes=[
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        self.health_probes += 1
        self.authorizations.append(request.headers.get("authorization"))
        return Response(status_code=200)

    async def generate(self, request: Request) -> Response:
        given = request.headers.get("authorization")
        self.authorizations.append(given)
        if self.api_key is not None and given != f"Bearer {self.api_key}":
            return Response(
                b'{"error":"Unauthorized"}', status_code=401, media_type="application/json"
            )
        body = orjson.loads(await request.body())
        errors = validate(body, image_token_id=self.image_token_id, runs=self.runs)
        if errors:
            return Response(orjson.dumps({"error": errors}), status_code=422)
        self.seen.append(body)
        rid = body["request_id"]
        n = min(len(self.script), body["sampling_params"].get("max_tokens", 16))
        finish = "length" if n < len(self.script) else "stop"
        if not body["stream"]:
            return Response(
                orjson.dumps(
                    {
                        "request_id": rid,
                        "output_mode": "tokens",
                        "choices": [
                            {"index": 0, "finish_reason": finish, "token_ids": self.script[:n]}
                        ],
                    }
                ),
                media_type="application/json",
            )

        async def events() -> Any:
            try:
                for i, tok in enumerate(self.script[:n]):
                    await anyio.sleep(self.delay_s)
                    last = i == n - 1
                    chunk = {
                        "request_id": rid,
                        "output_mode": "tokens",
                        "choices": [
                            {
                                "index": 0,
                                "token_ids": [tok],
                                "finish_reason": finish if last else None,
                            }
                        ],
                    }
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                yield b"data: [DONE]\n\n"
                self.completed.append(rid)
            finally:
                if rid not in self.completed:
                    self.abandoned.append(rid)

        return StreamingResponse(events(), media_type="text/event-stream")


class UpstreamServer:
    """A :class:`StandIn` served by uvicorn on loopback in a thread (a context manager); on
    ``port`` when given (to start it again where a stopped one listened), else a free one."""

    def __init__(self, standin: StandIn, port: int | None = None) -> None:
        import socket

        import uvicorn

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        self.port = port
        self.standin = standin
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(standin.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> UpstreamServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():  # the port was taken: uvicorn gave up
                raise RuntimeError(f"the stand-in could not listen on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
