"""Gateway mode: a rendered ``GenerateRequest`` -> the upstream's ``/inference/v1/generate``
(``vllm serve --tokens-only``) -> an OpenAI chat or completion response, or its SSE stream.

Generated token ids are detokenized with the model's tokenizer (incrementally when streaming:
:class:`IncrementalText`). Cancelling the caller closes the upstream
connection, which makes vLLM abort the request. One choice per request and no log
probabilities: a request asking for more (``n``, ``logprobs``, ``echo``) is refused rather than
answered with less; ``skip_special_tokens`` and ``stream_options`` (``include_usage``,
``continuous_usage_stats``) are honoured.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import orjson
from tokenizers.decoders import DecodeStream

from aiomm.engine._worker_pool import WorkerPool
from aiomm.processing.tokenize import plain_backend
from aiomm.server.json_chunks import dumps as dumps_json
from aiomm.server.readiness import DependencyDown
from aiomm.tracing import inject_context, set_attribute, span
from aiomm.vllm.errors import ApiError
from aiomm.vllm.request_values import flag

__all__ = ("IncrementalText", "Upstream", "refuse_unanswerable")

#: sampling params the gateway's answers cannot carry
_UNANSWERABLE = {
    "n": "one choice per request",
    "logprobs": "no log probabilities",
    "prompt_logprobs": "no prompt log probabilities",
}


def refuse_unanswerable(gen: dict[str, Any], body: dict[str, Any]) -> None:
    """Refuse a rendered request (``gen``, from ``body``) whose answer the gateway would give
    short.

    :raises ApiError: 400 naming the parameter.
    """
    if flag(body, "echo", False):
        raise ApiError(
            "'echo' is not supported by the gateway: it answers the generated text only",
            param="echo",
        )
    for key, why in _UNANSWERABLE.items():
        if key in gen["sampling_params"]:
            raise ApiError(f"'{key}' is not supported by the gateway: it answers {why}", param=key)


class IncrementalText:
    """The text a growing list of generated token ids adds, step by step.

    With a fast tokenizer, its backend's ``DecodeStream`` decodes only what each step adds (a
    2,000-token answer costs about 1.5 ms in all, where decoding the whole prefix again at each
    step cost 0.3 s, on the event loop); otherwise the whole prefix is decoded each step, without
    the wrapper's clean-up of spaces (which would rewrite text already sent). Either
    way an unfinished multi-byte character is held back until its last byte arrives. A model
    that emits bytes that are not UTF-8 (byte-fallback tokenizers) restarts the stream at that
    token instead of ending the response, as vLLM's detokenizer does.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # the wrapper's decode cleans up spaces after the backend's when asked to: the stream
        # would not
        cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.backend = None if cleans else plain_backend(tokenizer)
        self.stream = (
            DecodeStream(skip_special_tokens=skip_special_tokens) if self.backend else None
        )
        #: every id added so far
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: list[int]) -> str:
        """The text ``ids`` add to what came before."""
        self.ids.extend(ids)
        if self.stream is not None:
            pieces = (self._step(i) for i in ids)
            return "".join(p for p in pieces if p)
        # without the wrapper's clean-up, which rewrites text already sent ("don '" becomes
        # "don't" once the "t" arrives); vLLM's incremental detokenizer does not clean up either
        text = str(
            self.tokenizer.decode(
                self.ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False
            )
        )
        stable = text[:-1] if text.endswith("\ufffd") else text
        # a decoder that still changes sent text: what was sent stays sent, the stream goes on
        delta = stable[len(self.sent) :]
        if delta:
            self.sent = stable
        return delta

    def _step(self, token_id: int) -> str | None:
        assert self.stream is not None and self.backend is not None
        try:
            return self.stream.step(self.backend, token_id)
        except (OverflowError, TypeError):  # an id no token can have (beyond 32 bits)
            return None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # bytes that are not UTF-8 break the stream's state: start again at this token
            self.stream = DecodeStream(skip_special_tokens=self.skip)
            return self.stream.step(self.backend, token_id)


def trace_headers() -> dict[str, str]:
    """The current span's ``traceparent`` header (empty when tracing is off), for an upstream
    call made after the span ends (a streamed response)."""
    headers: dict[str, str] = {}
    inject_context(headers)
    return headers


def _client_status(upstream: int) -> int:
    """The status a client gets for the upstream's error ``upstream``: 502 for the upstream's
    own failures and for its refusal of the gateway's key (401 / 403: the gateway's
    ``--upstream-api-key`` is wrong, not the client's key), else the upstream's 4xx."""
    return 502 if upstream >= 500 or upstream in (401, 403) else upstream


#: how ``tokenizers``' DecodeStream reports a prefix it can no longer extend
_INVALID_PREFIX = "Invalid prefix encountered"


class Upstream:
    """An HTTP client for one upstream engine. ``pool``: the threads that join a request's
    body (its items' base64, megabytes per image, may be made as it is joined).

    ``api_key``: the upstream's own key (its ``--api-key``), sent as ``Authorization: Bearer``
    on every request to it; a client's key is never forwarded. :meth:`check_health` probes the
    upstream's ``/health`` over a connection of its own, so a full pool of long generations does
    not make the probe wait.
    """

    def __init__(
        self,
        base_url: str,
        tokenizer: Any,
        pool: WorkerPool,
        *,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.pool = pool
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers
        )
        self.probe_client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, limits=httpx.Limits(max_connections=1)
        )

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.probe_client.aclose()

    async def check_health(self) -> None:
        """Return when the upstream's ``/health`` answers 200 (the caller bounds the wait).

        :raises DependencyDown: it answered another status, or could not be reached.
        """
        try:
            resp = await self.probe_client.get("/health", timeout=None)
        except httpx.HTTPError as exc:
            raise DependencyDown(f"unreachable ({type(exc).__name__})") from exc
        if resp.status_code != 200:
            raise DependencyDown(f"/health answered {resp.status_code}")

    async def _body(self, gen: dict[str, Any]) -> bytes:
        """``gen`` as one JSON body, joined in a worker thread."""
        return await self.pool.run(dumps_json, gen)

    def _decode(self, ids: list[int], gen: dict[str, Any]) -> str:
        skip = gen["sampling_params"].get("skip_special_tokens", True)
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip))

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def complete(self, gen: dict[str, Any], *, chat: bool, model: str) -> dict[str, Any]:
        """A non-streaming OpenAI response for ``gen``.

        :raises ApiError: 502 when the upstream fails or answers malformed JSON.
        """
        gen = {**gen, "stream": False}
        try:
            with span("aiomm.upstream") as current:
                headers = {"content-type": "application/json"}
                inject_context(headers)  # the engine's spans join this request's trace
                resp = await self.client.post(
                    "/inference/v1/generate", content=await self._body(gen), headers=headers
                )
                set_attribute(current, "http.response.status_code", resp.status_code)
        except httpx.HTTPError as exc:
            raise ApiError(f"upstream unreachable: {type(exc).__name__}", status=502) from exc
        if resp.status_code != 200:
            raise ApiError(
                f"upstream answered {resp.status_code}: {resp.text[:300]}",
                status=_client_status(resp.status_code),
            )
        try:
            out = orjson.loads(resp.content)
            choice = out["choices"][0]
            ids = list(choice.get("token_ids") or [])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ApiError("upstream answered malformed JSON", status=502) from exc
        text = self._decode(ids, gen)
        finish = choice.get("finish_reason") or "stop"
        created = int(time.time())
        rid = gen["request_id"]
        usage = self._usage(len(gen["token_ids"]), len(ids))
        if chat:
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": finish,
                        "logprobs": None,
                        "message": {"role": "assistant", "content": text},
                    }
                ],
                "usage": usage,
            }
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": usage,
        }

    async def stream(
        self,
        gen: dict[str, Any],
        *,
        chat: bool,
        model: str,
        trace: Mapping[str, str] | None = None,
    ) -> AsyncIterator[bytes]:
        """OpenAI SSE events for ``gen``; an upstream failure ends the stream with an error event.
        ``trace``: the ``traceparent`` header of the request's span (:func:`trace_headers`,
        taken before the response streams: the span has ended by the time this runs).

        Leaving the iteration early (a client that disconnected) closes the upstream stream.
        """
        gen = {**gen, "stream": True}
        rid, created = gen["request_id"], int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        text = IncrementalText(
            self.tokenizer,
            skip_special_tokens=gen["sampling_params"].get("skip_special_tokens", True),
        )

        options = gen.get("stream_options") or {}
        continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))

        def event(delta: str | None, finish: str | None, *, role: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if delta:
                    d["content"] = delta
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": d,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {
                    "index": 0,
                    "text": delta or "",
                    "logprobs": None,
                    "finish_reason": finish,
                }
            obj = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if continuous:  # usage so far in every chunk, as vLLM's continuous_usage_stats
                obj["usage"] = self._usage(len(gen["token_ids"]), len(text.ids))
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        if chat:
            yield event(None, None, role=True)
        headers = {"content-type": "application/json", **(trace or {})}
        try:
            async with self.client.stream(
                "POST", "/inference/v1/generate", content=await self._body(gen), headers=headers
            ) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread())[:300].decode(errors="replace")
                    raise ApiError(f"upstream answered {resp.status_code}: {body}", status=502)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = orjson.loads(payload)
                    if not chunk["choices"]:  # vLLM's last chunk with include_usage: usage only
                        continue
                    choice = chunk["choices"][0]
                    delta = text.add(choice.get("token_ids") or [])
                    finish = choice.get("finish_reason")
                    if delta or finish:
                        yield event(delta, finish)
        except ApiError as exc:
            yield b"data: " + orjson.dumps(exc.body()) + b"\n\n"
        except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, IndexError) as exc:
            err = ApiError(f"upstream stream failed: {type(exc).__name__}", status=502)
            yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
        else:
            if options.get("include_usage"):
                usage = {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(len(gen["token_ids"]), len(text.ids)),
                }
                yield b"data: " + orjson.dumps(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"
