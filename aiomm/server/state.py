"""A running app's state: the engine, the render service, the upstream client, metrics and
readiness, opened and closed by :func:`open_state`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from aiomm.config import EngineConfig, available_cores
from aiomm.engine import Engine
from aiomm.logging import get_logger
from aiomm.server.config import ServerConfig, encode_on_send
from aiomm.server.gateway import Upstream
from aiomm.server.metrics import ServerMetrics
from aiomm.server.readiness import Check, Readiness, redis_check
from aiomm.server.render import RenderService, render_engine
from aiomm.tuning import malloc as memory
from aiomm.tuning import tuned
from aiomm.vllm.errors import ApiError
from aiomm.vllm.generate_request import model_float_dtype
from aiomm.vllm.sampling import SamplingDefaults

__all__ = ("ServerState", "StateHolder", "model_folder", "open_state")

log = get_logger(__name__)


class ServerState:
    """Everything a running app holds (opened by the lifespan)."""

    service: RenderService
    upstream: Upstream | None
    metrics: ServerMetrics
    engine: Engine
    readiness: Readiness


class StateHolder:
    """The running app's :class:`ServerState`: set by the lifespan, read by every route."""

    def __init__(self) -> None:
        self.current: ServerState | None = None

    def get(self) -> ServerState:
        """The state of the running app.

        :raises ApiError: 503, the app is starting or stopping.
        """
        if self.current is None:
            raise ApiError("the server is starting or stopping", status=503)
        return self.current


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
async def open_state(config: ServerConfig) -> AsyncIterator[ServerState]:
    """Open the engine, fetcher and upstream client of ``config``; close them on exit."""
    from transformers import AutoTokenizer

    folder = model_folder(config.model)
    engine_cfg = config.engine or EngineConfig(device="cpu")
    if config.tuned:
        engine_cfg = tuned(engine_cfg)
    if not engine_cfg.return_items:
        engine_cfg = replace(engine_cfg, return_items=True)
    overrides: dict[str, Any] = {
        "shared_cache_url": config.shared_cache_url or None,
        "peer_cache_dir": config.peer_cache_dir or None,
        "transform_threads": config.transform_threads,
        "busy_transform_threads": config.busy_transform_threads,
        "cache_capacity_bytes": config.cache_bytes,
    }
    engine_cfg = replace(engine_cfg, **{k: v for k, v in overrides.items() if v is not None})
    fetch: dict[str, Any] = {}
    if config.allowed_local_media_path or engine_cfg.fetch.allowed_local_root is None:
        # a refused file: URL names the server's flag (vLLM's), not the library's field
        fetch["local_root_setting"] = "--allowed-local-media-path"
    if config.allowed_local_media_path:
        fetch["allowed_local_root"] = Path(config.allowed_local_media_path)
    if config.allowed_media_domains:
        fetch["allowed_media_domains"] = tuple(config.allowed_media_domains)
    if config.allow_private_networks:
        fetch.update(allow_loopback=True, allow_private_addresses=True)
    engine_cfg = replace(engine_cfg, fetch=replace(engine_cfg.fetch, **fetch))
    pretouch = (
        config.cache_pretouch and engine_cfg.tune_malloc and engine_cfg.cache_capacity_bytes > 0
    )
    if pretouch:
        memory.use_one_arena()  # before the engine starts its threads
    engine = render_engine(
        folder, engine_cfg, model_id=config.model_id or config.model, limits=config.limits
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    state = ServerState()
    state.metrics = ServerMetrics()
    state.engine = engine
    async with contextlib.AsyncExitStack() as stack:
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
            served_names=config.served_model_names or (config.model,),
            defaults=SamplingDefaults.from_folder(folder),
            limits=config.limits,
            float_dtype=model_float_dtype(folder),
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
