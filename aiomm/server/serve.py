"""Running the app: uvicorn with uvloop and :class:`.RenderHttpProtocol` (httptools, large
bodies written outside the GIL), one process or ``--workers N`` (:mod:`.runtime.supervisor`: a
listening socket per worker).

With several workers each process imports :func:`app_from_env`; the configuration travels in the
``AIOMM_SERVE_CONFIG`` environment variable (JSON; the API keys with it, readable as
``VLLM_API_KEY`` is, only by the server's user). uvicorn drains in-flight requests on SIGTERM
(``timeout_graceful_shutdown``) and then runs the lifespan's shutdown, which closes the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from aiomm.config import EngineConfig, available_cores
from aiomm.logging import configure_logging
from aiomm.server.app import ServerConfig, create_app, encode_on_send
from aiomm.server.render import RenderLimits
from aiomm.server.runtime.protocol import RenderHttpProtocol
from aiomm.server.runtime.settle import ServingServer
from aiomm.server.runtime.supervisor import run_workers
from aiomm.tuning.malloc import prefer_small_pages, pretouch_fits

__all__ = ("app_from_env", "serve", "worker_config")

_ENV = "AIOMM_SERVE_CONFIG"


def _to_env(config: ServerConfig) -> str:
    data = asdict(config)
    data.pop("engine")
    return json.dumps(data)


def _from_env(text: str) -> ServerConfig:
    data: dict[str, Any] = json.loads(text)
    data["limits"] = RenderLimits(**data["limits"])
    data["served_model_names"] = tuple(data["served_model_names"])
    data["api_keys"] = tuple(data.get("api_keys", ()))
    data["allowed_media_domains"] = tuple(data.get("allowed_media_domains", ()))
    return ServerConfig(**data)


def _cache_budget(config: ServerConfig) -> int:
    """The whole server's item-cache bytes (the engine's default when unset)."""
    return EngineConfig.cache_capacity_bytes if config.cache_bytes is None else config.cache_bytes


def worker_config(config: ServerConfig, workers: int, cores: int | None = None) -> ServerConfig:
    """``config`` as each of ``workers`` processes runs it: an equal share of the server's
    ``cache_bytes`` (the engine's default when None) and, when unset, of the host's ``cores``
    (default: the ones this process may run on) for its transform threads under load
    (``busy_transform_threads``; none with one worker) and for ``encode_on_send``."""
    total = _cache_budget(config)
    share = max(1, (available_cores() if cores is None else cores) // workers)
    busy = config.busy_transform_threads
    if busy is None and workers > 1:
        busy = share
    # one budget for the server, not one per process: more workers must not multiply its
    # memory, and with the peer tier their caches hold one set of items between them
    return replace(
        config,
        cache_bytes=total // workers,
        busy_transform_threads=busy,
        encode_on_send=encode_on_send(config, share),
    )


def app_from_env() -> Starlette:
    """The app of a worker process (its config from ``AIOMM_SERVE_CONFIG``)."""
    configure_logging(level="INFO", json=True)
    return create_app(_from_env(os.environ[_ENV]))


def serve(
    config: ServerConfig,
    *,
    host: str,
    port: int,
    workers: int = 1,
    peer_cache: bool = True,
    pin_workers: bool = False,
) -> int:
    """Serve ``config`` until SIGINT / SIGTERM (in-flight requests are drained); return the exit
    status (1: a worker failed at the server's start; 3, uvicorn's: the app of a one-process
    server failed to start).

    ``peer_cache``: with several workers and no Redis tier, the workers copy items from each
    other (:mod:`aiomm.cache.peer`) through a private directory made here (on tmpfs where there
    is one) and removed at exit. ``config.cache_bytes`` (default: the engine's 4 GiB) is the
    whole server's: each worker caches an equal share of it. ``pin_workers``: with several
    workers, each runs on its own share of the cores (:mod:`aiomm.server.runtime.pinning`).
    """
    import uvicorn

    prefer_small_pages()  # a server's arrays are filled once: small pages cost less

    options: dict[str, Any] = {
        "loop": "uvloop",
        # httptools' C parser (h11, in pure Python, costs milliseconds per megabyte of data
        # URLs), and large bodies written outside the GIL
        "http": RenderHttpProtocol,
        # no WebSocket routes: an upgrade would swap the protocol and leave its connection
        # counted by the worker's balance (runtime.balance) for good
        "ws": "none",
        "access_log": False,
        "timeout_graceful_shutdown": max(5, int(config.limits.timeout_s)),
    }
    if config.cache_pretouch and not pretouch_fits(_cache_budget(config)):
        config = replace(config, cache_pretouch=False)  # warned: the host lacks the memory
    if workers > 1:
        with contextlib.ExitStack() as stack:
            if peer_cache and not config.shared_cache_url and config.peer_cache_dir is None:
                shm = Path("/dev/shm")
                folder = stack.enter_context(
                    tempfile.TemporaryDirectory(
                        prefix="aiomm-peers-", dir=shm if shm.is_dir() else None
                    )
                )
                config = replace(config, peer_cache_dir=folder)
            os.environ[_ENV] = _to_env(worker_config(config, workers))
            return run_workers(host, port, workers, options, pin=pin_workers)
    server = ServingServer(uvicorn.Config(create_app(config), host=host, port=port, **options))
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3  # uvicorn's STARTUP_FAILURE
