"""What every POST route shares: the JSON body read under its size limit (large data URLs lifted
out of the parse, :mod:`.data_urls`), the handler run until it answers or its client leaves,
errors as OpenAI error bodies, and the request counted in the metrics and the log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from aiomm.logging import get_logger
from aiomm.server.data_urls import attach, lift_data_urls
from aiomm.server.disconnect import until_disconnect
from aiomm.server.json_chunks import ChunkedJSONResponse, dumps_chunks
from aiomm.server.state import StateHolder
from aiomm.tracing import attached, extract_context, set_attribute, span
from aiomm.vllm.content import Parsed
from aiomm.vllm.errors import ApiError

__all__ = (
    "Handler",
    "endpoint",
    "header_id",
    "json_response",
    "parsed_media",
    "read_body",
    "render_json_response",
)

log = get_logger(__name__)

#: a POST route's work: the request and its parsed JSON body in, the response out
Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` as a JSON response (orjson)."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def render_json_response(obj: Any) -> Response:
    """A render response: it holds megabytes of base64 per image, so it is sent in its pieces,
    never joined."""
    return ChunkedJSONResponse(dumps_chunks(obj))


def header_id(request: Request) -> str | None:
    """The request's ``X-Request-Id`` header, which vLLM takes over a body's ``request_id``."""
    return request.headers.get("x-request-id")


async def read_body(
    request: Request, holder: StateHolder, max_body_bytes: int, lift: bool = False
) -> dict[str, Any]:
    """The request's JSON object; with ``lift``, its large data-URL payloads are decoded from
    the raw bytes and left out of the parse (:mod:`.data_urls`, kept in
    ``request.state.data_urls`` for :func:`parsed_media`).

    :raises ApiError: 413 above ``max_body_bytes``; 400 for a body that is not a JSON object.
    """
    size = int(request.headers.get("content-length") or 0)
    if size > max_body_bytes:
        raise ApiError(
            f"request body of {size} bytes is above the limit of {max_body_bytes}", status=413
        )
    raw: bytes | bytearray = b""
    async for chunk in request.stream():
        if not chunk:  # Starlette ends every stream with an empty chunk
            continue
        if not raw:
            raw = chunk  # the whole body, as RenderHttpProtocol reads it: no copy
        else:
            if isinstance(raw, bytes):
                raw = bytearray(raw)
            raw += chunk
        if len(raw) > max_body_bytes:
            raise ApiError(f"request body above the limit of {max_body_bytes} bytes", status=413)
    state = holder.get()
    state.metrics.bytes_in.inc(len(raw))
    lifted = None
    if lift and raw:
        raw, lifted = lift_data_urls(raw, state.engine.config.fetch.max_bytes)
        request.state.data_urls = lifted
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        error = exc
        if lifted is not None:  # the error, with its position, of the body as sent
            try:
                orjson.loads(lifted.raw)
            except orjson.JSONDecodeError as sent:
                error = sent
        raise ApiError(f"malformed JSON body: {error}") from error
    if not isinstance(body, dict):
        raise ApiError("the JSON body must be an object")
    return body


def parsed_media(
    request: Request, body: dict[str, Any], parse: Callable[[dict[str, Any]], Parsed]
) -> Parsed:
    """``parse(body)`` with the payloads :func:`read_body` lifted out of it put back.

    When a reference is not a media part's URL (or the parse refuses the body), ``body`` is
    replaced in place by the body as it was sent, for every later reader, and parsed again.
    """
    lifted = getattr(request.state, "data_urls", None)
    if lifted is None:
        return parse(body)
    request.state.data_urls = None  # the raw body is not held beyond this
    parsed: Parsed | None
    try:
        parsed = attach(parse(body), lifted)
    except ApiError:
        parsed = None  # its error is the one the body as sent gives
    # attached: every reference was a media part's URL, so no other field holds one
    if parsed is None:
        body.clear()
        body.update(orjson.loads(lifted.raw))
        parsed = parse(body)
    return parsed


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    try:
        await until_disconnect(request.receive)
    except Exception:  # no watching this connection: its work runs to its end, as before
        return
    scope.cancel()  # the client left: drop its work


def endpoint(
    name: str,
    handler: Handler,
    holder: StateHolder,
    max_body_bytes: int,
    lift: bool = False,
) -> Callable[[Request], Awaitable[Response]]:
    """The Starlette endpoint of ``handler``: reads the body (:func:`read_body`), runs the
    handler until it answers or the client leaves (499, its work cancelled), answers an
    :class:`ApiError` with its status and body and any other exception with a 500 (the server
    keeps serving), and counts the request as ``name`` in the metrics and the log."""

    async def run(request: Request) -> Response:
        # a trace the client started (W3C traceparent) is this request's parent
        with (
            attached(extract_context(request.headers)),
            span("aiomm.render", {"aiomm.endpoint": name}) as current,
        ):
            response = await answer(request)
            set_attribute(current, "http.response.status_code", response.status_code)
            return response

    async def answer(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            body = await read_body(request, holder, max_body_bytes, lift)
            response: Response | None = None
            error: ApiError | None = None
            with anyio.CancelScope() as scope:
                # the handler runs in this task; one bare task watches for the client leaving
                # (a task group of two costs a plan-only request a twentieth of its CPU)
                watcher = asyncio.get_running_loop().create_task(
                    _cancel_on_disconnect(request, scope)
                )
                try:
                    response = await handler(request, body)
                except ApiError as exc:
                    error = exc
                except Exception as exc:  # a bug: answer 500, keep serving
                    log.exception("request_crashed", endpoint=name)
                    error = ApiError(f"internal error: {type(exc).__name__}", status=500)
                finally:
                    watcher.cancel()
            if error is not None:
                raise error
            if response is None:  # the client left first: 499, as nginx logs it
                log.info("request_cancelled", endpoint=name)
                response = Response(status_code=499)
        except ClientDisconnect:  # gone while sending its body
            response = Response(status_code=499)
        except ApiError as exc:
            if holder.current is not None:
                holder.current.metrics.errors.labels(exc.type).inc()
            response = json_response(exc.body(), exc.status)
        status = response.status_code
        seconds = time.perf_counter() - t0
        if holder.current is not None:
            metrics = holder.current.metrics
            metrics.requests.labels(name, str(status)).inc()
            metrics.latency.labels(name).observe(seconds)
            if isinstance(response, ChunkedJSONResponse):
                metrics.bytes_out.inc(response.body_length)
            elif not isinstance(response, StreamingResponse):
                metrics.bytes_out.inc(len(response.body))
        log.info("request", endpoint=name, status=status, ms=round(seconds * 1000, 2))
        return response

    return run
