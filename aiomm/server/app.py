"""The ASGI application of ``aiomm serve``: vLLM's render API, OpenAI gateway routes, health,
readiness, models, tokenize and Prometheus metrics (Starlette).

With :attr:`ServerConfig.api_keys` the paths vLLM guards with ``--api-key`` (``/v1``, ``/v2``,
``/inference``, ``/cohere``) answer vLLM's 401 ``{"error":"Unauthorized"}`` without one of the
keys as a Bearer token (:mod:`.auth`); ``/health``, ``/ready``, ``/metrics`` and ``/tokenize``
stay open, as vLLM leaves them. ``/health`` is liveness, as vLLM's; ``/ready`` (and ``/readyz``)
answers 200 only while the upstream engine (gateway mode) answers, else 503 naming it; a shared
Redis cache that does not answer is named under ``degraded`` (the engine computes locally
meanwhile) without making the server unready (:mod:`.readiness`).

:func:`create_app` builds it for a model folder; mount it in an existing ASGI gateway with
``Mount("/render", app=create_app(...))`` (its lifespan opens the engine, so the parent must run
sub-app lifespans, or call :func:`open_state` itself). Bodies are parsed and responses encoded
with orjson; bad input is a 4xx OpenAI error body and never disturbs other requests; a client
that disconnects cancels its request's work.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from aiomm import memory
from aiomm.adapters import hf_class_name
from aiomm.config import EngineConfig, available_cores
from aiomm.engine import Engine
from aiomm.fetch import MediaFetcher
from aiomm.logging import get_logger

from .auth import ApiKeyMiddleware
from .content import Parsed, parse_anthropic, parse_chat, parse_responses
from .data_urls import attach, lift_data_urls
from .disconnect import until_disconnect
from .errors import ApiError
from .gateway import Upstream, refuse_unanswerable
from .json_chunks import ChunkedJSONResponse, dumps_chunks
from .media import VllmDecoder
from .metrics import ServerMetrics
from .readiness import Check, Readiness, ReadinessReport, redis_check
from .render import RenderLimits, RenderService, model_float_dtype
from .request_fields import own_fields
from .request_values import flag
from .sampling import SamplingDefaults
from .video_media import video_loader

__all__ = (
    "ENCODE_ON_SEND_CORES",
    "ServerConfig",
    "create_app",
    "encode_on_send",
    "model_folder",
)

log = get_logger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """What ``aiomm serve`` configures."""

    #: a model folder, or a registered short name (its offline folder: :func:`model_folder`)
    model: str
    #: the model id vLLM hashes items with: the model path as given to vLLM (default: ``model``)
    model_id: str | None = None
    served_model_names: tuple[str, ...] = ()
    upstream: str | None = None
    max_body_bytes: int = 64 << 20
    limits: RenderLimits = field(default_factory=RenderLimits)
    allowed_local_media_path: str | None = None
    #: a Redis item cache shared by every replica (``redis://HOST:PORT/DB``; see
    #: ``EngineConfig.shared_cache_url``), set on the engine's configuration
    shared_cache_url: str | None = None
    #: the directory the workers of ``--workers N`` share items through (``serve`` makes it;
    #: see ``EngineConfig.peer_cache_dir``), set on the engine's configuration
    peer_cache_dir: str | None = None
    #: the engine's transform threads per process (``EngineConfig.transform_threads``); None:
    #: the engine's default, one per core
    transform_threads: int | None = None
    #: of those, the threads that run at once while two or more requests are in flight
    #: (``EngineConfig.busy_transform_threads``); None: the engine's (all of them).
    #: :func:`~aiomm.server.serve.serve` gives each of ``--workers N`` its share of the cores
    busy_transform_threads: int | None = None
    #: bytes of items the server caches in memory (``EngineConfig.cache_capacity_bytes``), all of
    #: its processes together: :func:`~aiomm.server.serve.serve` gives each of ``--workers N`` an
    #: N-th, since the workers read each other's items; 0: nothing in memory (a Redis tier still
    #: caches); None: the engine's default (4 GiB, vLLM's ``--mm-processor-cache-gb`` default,
    #: which vLLM gives each process) in all
    cache_bytes: int | None = None
    #: fault in this process's cache budget before serving (:func:`aiomm.memory.pretouch_heap`;
    #: ``aiomm serve`` turns it on): the cache's growth then costs no page faults while it
    #: serves; the process holds the budget's memory from its start
    cache_pretouch: bool = False
    #: make each item's base64 on the event loop while the response sends it, each piece
    #: written while still in the core's cache (``True``), or whole in the encode threads
    #: before the response starts (``False``); None: on when this process's share of the cores
    #: is at most 2 (:data:`ENCODE_ON_SEND_CORES`), where the loop has time to spare; with more
    #: cores per process the encode threads spread the base64 over them.
    #: :func:`~aiomm.server.serve.serve` gives each of ``--workers N`` its share
    encode_on_send: bool | None = None
    #: the engine's configuration (its ``fetch`` is the URL policy; ``return_items`` is forced)
    engine: EngineConfig | None = None
    #: keys a client must send as ``Authorization: Bearer KEY`` on the paths vLLM guards
    #: (``/v1``, ``/v2``, ``/inference``, ``/cohere``; :mod:`.auth`), any one of them; empty: no
    #: key. ``aiomm serve`` takes them from ``--api-key`` or ``VLLM_API_KEY``, as vLLM does;
    #: this field reads no environment. Left out of the repr
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: the upstream engine's own key (its ``--api-key``), sent as ``Authorization: Bearer`` on
    #: every gateway request to it; never one of ``api_keys`` a client sent. Left out of the repr
    upstream_api_key: str | None = field(default=None, repr=False)
    #: ``/ready``: how long each dependency check (the upstream's ``/health``, a Redis ``PING``)
    #: may take, and how long its report is reused by the probes that follow (:mod:`.readiness`)
    ready_timeout_s: float = 0.5
    ready_cache_s: float = 1.0


#: :attr:`ServerConfig.encode_on_send` is on by default up to this many cores per process
ENCODE_ON_SEND_CORES = 2


def encode_on_send(config: ServerConfig, cores: int) -> bool:
    """``config``'s :attr:`ServerConfig.encode_on_send`, or when unset its default for a process
    with ``cores`` of its own."""
    if config.encode_on_send is not None:
        return config.encode_on_send
    return cores <= ENCODE_ON_SEND_CORES


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _render_json(obj: Any) -> Response:
    # a render response holds megabytes of base64 per image: sent in its pieces, never joined
    return ChunkedJSONResponse(dumps_chunks(obj))


class _State:
    """Everything a running app holds (opened by the lifespan)."""

    service: RenderService
    upstream: Upstream | None
    metrics: ServerMetrics
    engine: Engine
    readiness: Readiness


def model_folder(model: str) -> Path:
    """The folder ``aiomm serve MODEL`` loads: ``model`` itself when it is a directory, else the
    offline folder of a registered architecture or short name (built once into the cache,
    :func:`aiomm.adapters.folders.model_folder`).

    :raises UnknownArchitectureError: ``model`` is neither a folder nor a registered name.
    """
    folder = Path(model)
    if folder.is_dir():
        return folder
    from aiomm.adapters import folders

    return folders.model_folder(model)


@contextlib.asynccontextmanager
async def open_state(config: ServerConfig) -> AsyncIterator[_State]:
    """Open the engine, fetcher and upstream client of ``config``; close them on exit."""
    from transformers import AutoTokenizer

    folder = model_folder(config.model)
    engine_cfg = config.engine or EngineConfig(device="cpu", torch_threads=1)
    if not engine_cfg.return_items:
        engine_cfg = replace(engine_cfg, return_items=True)
    overrides = {
        "shared_cache_url": config.shared_cache_url or None,
        "peer_cache_dir": config.peer_cache_dir or None,
        "transform_threads": config.transform_threads,
        "busy_transform_threads": config.busy_transform_threads,
        "cache_capacity_bytes": config.cache_bytes,
    }
    engine_cfg = replace(engine_cfg, **{k: v for k, v in overrides.items() if v is not None})
    root = config.allowed_local_media_path
    fetch_cfg = engine_cfg.fetch
    if root:
        fetch_cfg = replace(fetch_cfg, allowed_local_root=Path(root))
    pretouch = (
        config.cache_pretouch and engine_cfg.tune_malloc and engine_cfg.cache_capacity_bytes > 0
    )
    if pretouch:
        memory.use_one_arena()  # before the engine starts its threads
    base = Engine.from_pretrained(folder, engine_cfg)
    loader = video_loader(hf_class_name(getattr(base.processor, "video_processor", None)))
    decoder = VllmDecoder(
        engine_cfg.decode, max_pixels=base.max_pixels, video_loader=loader or "qwen2_vl"
    )
    engine = Engine(base.processor, engine_cfg, adapter_id=base.adapter_id, decoder=decoder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    state = _State()
    state.metrics = ServerMetrics()
    state.engine = engine
    async with contextlib.AsyncExitStack() as stack:
        fetcher = await stack.enter_async_context(MediaFetcher(fetch_cfg))
        await stack.enter_async_context(engine)
        if pretouch:
            # in a thread: the engine's own loop tasks (the peer tier's listener) keep running
            touched = await anyio.to_thread.run_sync(
                memory.pretouch_heap, engine_cfg.cache_capacity_bytes
            )
            state.metrics.cache_pretouched.set(touched)
        state.service = RenderService(
            engine,
            tokenizer,
            model_id=config.model_id or config.model,
            served_names=config.served_model_names or (config.model,),
            defaults=SamplingDefaults.from_folder(folder),
            fetcher=fetcher,
            limits=config.limits,
            float_dtype=model_float_dtype(folder),
            decoder=decoder,
            encode_on_send=encode_on_send(config, available_cores()),
        )
        stack.push_async_callback(state.service.aclose)
        state.upstream = (
            Upstream(
                config.upstream,
                tokenizer,
                state.service.encode_pool,
                api_key=config.upstream_api_key,
            )
            if config.upstream
            else None
        )
        checks: dict[str, Check] = {}
        if state.upstream is not None:
            stack.push_async_callback(state.upstream.aclose)
            checks["upstream"] = state.upstream.check_health
        if engine_cfg.shared_cache_url:
            ping, close = redis_check(engine_cfg.shared_cache_url, config.ready_timeout_s)
            stack.push_async_callback(close)
            checks["shared_cache"] = ping
        state.readiness = Readiness(
            checks,
            optional=frozenset({"shared_cache"}),  # without it the engine computes locally
            timeout_s=config.ready_timeout_s,
            cache_s=config.ready_cache_s,
        )
        log.info(
            "server_open",
            model=config.model,
            upstream=config.upstream,
            api_key=bool(config.api_keys),
        )
        yield state


def create_app(config: ServerConfig) -> Starlette:
    """The ASGI app for ``config`` (see the module docstring)."""
    holder: dict[str, _State] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with open_state(config) as state:
            holder["state"] = state
            yield
            holder.clear()

    def state() -> _State:
        if "state" not in holder:
            raise ApiError("the server is starting or stopping", status=503)
        return holder["state"]

    async def body_of(request: Request, lift: bool = False) -> dict[str, Any]:
        """The request's JSON object; with ``lift``, its large data-URL payloads are decoded
        from the raw bytes and left out of the parse (:mod:`.data_urls`, kept in
        ``request.state.data_urls`` for :func:`parsed_media`)."""
        size = int(request.headers.get("content-length") or 0)
        if size > config.max_body_bytes:
            raise ApiError(
                f"request body of {size} bytes is above the limit of {config.max_body_bytes}",
                status=413,
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
            if len(raw) > config.max_body_bytes:
                raise ApiError(
                    f"request body above the limit of {config.max_body_bytes} bytes", status=413
                )
        state().metrics.bytes_in.inc(len(raw))
        lifted = None
        if lift and raw:
            raw, lifted = lift_data_urls(raw, state().service.fetcher.config.max_bytes)
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

    def endpoint(
        name: str,
        handler: Callable[[Request, dict[str, Any]], Awaitable[Response]],
        lift: bool = False,
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                body = await body_of(request, lift)
                response: Response | None = None
                error: ApiError | None = None
                async with anyio.create_task_group() as tg:

                    async def work() -> None:
                        nonlocal response, error
                        try:
                            response = await handler(request, body)
                        except ApiError as exc:
                            error = exc
                        except Exception as exc:  # a bug: answer 500, keep serving
                            log.exception("request_crashed", endpoint=name)
                            error = ApiError(f"internal error: {type(exc).__name__}", status=500)
                        tg.cancel_scope.cancel()

                    async def watch() -> None:
                        await until_disconnect(request.receive)
                        tg.cancel_scope.cancel()  # the client left: drop its work

                    tg.start_soon(work)
                    tg.start_soon(watch)
                if error is not None:
                    raise error
                if response is None:  # the client left first: 499, as nginx logs it
                    log.info("request_cancelled", endpoint=name)
                    response = Response(status_code=499)
            except ClientDisconnect:  # gone while sending its body
                response = Response(status_code=499)
            except ApiError as exc:
                state_ = holder.get("state")
                if state_ is not None:
                    state_.metrics.errors.labels(exc.type).inc()
                response = _json(exc.body(), exc.status)
            status = response.status_code
            seconds = time.perf_counter() - t0
            metrics = holder["state"].metrics if "state" in holder else None
            if metrics is not None:
                metrics.requests.labels(name, str(status)).inc()
                metrics.latency.labels(name).observe(seconds)
                if isinstance(response, ChunkedJSONResponse):
                    metrics.bytes_out.inc(response.body_length)
                elif not isinstance(response, StreamingResponse):
                    metrics.bytes_out.inc(len(response.body))
            log.info("request", endpoint=name, status=status, ms=round(seconds * 1000, 2))
            return response

        return run

    def parsed_media(
        request: Request, body: dict[str, Any], parse: Callable[[dict[str, Any]], Parsed]
    ) -> Parsed:
        """``parse(body)`` with the payloads :func:`body_of` lifted out of it put back.

        When a reference is not a media part's URL (or the parse refuses the body), ``body`` is
        replaced in place by the body as it was sent, for every later reader, and parsed again.
        """
        lifted = getattr(request.state, "data_urls", None)
        if lifted is None:
            return parse(body)
        request.state.data_urls = None  # the raw body is not held beyond this
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

    async def _render(
        request: Request,
        body: dict[str, Any],
        parse: Callable[[dict[str, Any]], Parsed],
        **kwargs: Any,
    ) -> dict[str, Any]:
        s = state()
        rendered = await s.service.render(parsed_media(request, body, parse), body, **kwargs)
        s.metrics.images.inc(rendered.images)
        s.metrics.cache.labels("hit").inc(rendered.cache_hits)
        s.metrics.cache.labels("miss").inc(rendered.images - rendered.cache_hits)
        s.metrics.observe_timings(rendered.timings)
        return rendered.response

    async def chat_render(request: Request, body: dict[str, Any]) -> Response:
        return _render_json(
            await _render(request, body, parse_chat, api="chat", header_id=_header_id(request))
        )

    async def responses_render(request: Request, body: dict[str, Any]) -> Response:
        return _render_json(
            await _render(
                request,
                body,
                parse_responses,
                api="responses",
            )
        )

    async def messages_render(request: Request, body: dict[str, Any]) -> Response:
        return _render_json(
            await _render(
                request,
                body,
                functools.partial(
                    parse_anthropic,
                    merge_inline_system=state().service.chat.merges_inline_system,
                ),
                api="messages",
                header_id=_header_id(request),
            )
        )

    async def completions_render(request: Request, body: dict[str, Any]) -> Response:
        return _json(await state().service.render_text(body, header_id=_header_id(request)))

    async def tokenize(request: Request, body: dict[str, Any]) -> Response:
        s = state().service
        s.check_model(body)
        if "messages" in body:
            # vLLM's validator reads the raw JSON: only an explicit add_generation_prompt clashes
            if body.get("continue_final_message") and body.get("add_generation_prompt"):
                raise ApiError(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
            # rendered as a chat request, images expanded (vLLM's preprocess_chat), no payload
            chat = own_fields(body, "tokenize")
            if chat.get("tools") == []:  # /tokenize takes an empty list the chat route refuses
                del chat["tools"]
            rendered = await s.render(parse_chat(chat), {**chat, "mm_payload": "none"})
            ids = rendered.response["token_ids"]
        elif isinstance(body.get("prompt"), str):
            ids = await s.chat.aencode(body["prompt"])
        else:
            raise ApiError("give 'prompt' or 'messages'", param="prompt")
        return _json(
            {
                "count": len(ids),
                "max_model_len": s.defaults.max_model_len,
                "tokens": ids,
                "token_strs": s.tokenizer.convert_ids_to_tokens(ids)
                if flag(body, "return_token_strs", False)
                else None,
            }
        )

    async def gateway(request: Request, body: dict[str, Any], *, chat: bool) -> Response:
        s = state()
        if s.upstream is None:
            raise ApiError("this server has no --upstream; use the /render endpoints", status=404)
        if chat:
            gen = await _render(
                request, body, parse_chat, api="chat", header_id=_header_id(request)
            )
        else:
            gens = await s.service.render_text(body, header_id=_header_id(request))
            if len(gens) != 1:
                raise ApiError(
                    "the gateway takes one prompt per completion request", param="prompt"
                )
            gen = gens[0]
        refuse_unanswerable(gen, body)
        model = str(body.get("model") or s.service.served_names[0])
        if gen["stream"]:  # the body's, read as a bool field by generate_request
            return StreamingResponse(
                s.upstream.stream(gen, chat=chat, model=model), media_type="text/event-stream"
            )
        return _json(await s.upstream.complete(gen, chat=chat, model=model))

    async def chat_completions(request: Request, body: dict[str, Any]) -> Response:
        return await gateway(request, body, chat=True)

    async def completions(request: Request, body: dict[str, Any]) -> Response:
        return await gateway(request, body, chat=False)

    async def models(request: Request) -> Response:
        names = config.served_model_names or (config.model,)
        created = int(time.time())
        try:
            max_model_len = state().service.defaults.max_model_len
        except ApiError as exc:  # before the lifespan ran, or after it: a JSON 503
            return _json(exc.body(), exc.status)
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": n,
                        "object": "model",
                        "created": created,
                        "owned_by": "aiomm",
                        "root": config.model,
                        "parent": None,
                        "max_model_len": max_model_len,
                    }
                    for n in names
                ],
            }
        )

    async def health(request: Request) -> Response:
        """Liveness, as vLLM's render server answers it: 200 once started, no body."""
        return Response(status_code=200 if "state" in holder else 503)

    async def ready(request: Request) -> Response:
        """Readiness (:mod:`.readiness`): 200 when every required dependency answers, else 503
        naming the ones that do not."""
        s = holder.get("state")
        if s is None:
            report = ReadinessReport({"server": "starting or stopping"})
        else:
            report = await s.readiness.report()
        return _json(report.body(), 200 if report.ready else 503)

    async def metrics(request: Request) -> Response:
        s = holder.get("state")
        if s is None:
            return Response(status_code=503)
        exposition = s.metrics.render(
            s.engine.stats(), {"encode": s.service.encode_pool.statistics()}
        )
        return Response(exposition, media_type="text/plain; version=0.0.4")

    def post(path: str, name: str, handler: Any, lift: bool = False) -> Route:
        return Route(path, endpoint(name, handler, lift), methods=["POST"])

    routes = [
        post("/v1/chat/completions/render", "chat_render", chat_render, lift=True),
        post("/v1/responses/render", "responses_render", responses_render, lift=True),
        post("/v1/messages/render", "messages_render", messages_render, lift=True),
        post("/v1/completions/render", "completions_render", completions_render),
        post("/tokenize", "tokenize", tokenize),
        post("/v1/chat/completions", "chat_completions", chat_completions, lift=True),
        post("/v1/completions", "completions", completions),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/readyz", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, keys=config.api_keys)] if config.api_keys else []
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


def _header_id(request: Request) -> str | None:
    """The request's ``X-Request-Id`` header, which vLLM takes over a body's ``request_id``."""
    return request.headers.get("x-request-id")
