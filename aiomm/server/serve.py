"""Running the app: uvicorn with uvloop and :class:`.RenderHttpProtocol` (httptools, large
bodies written outside the GIL), one process or ``--workers N``.

With several workers uvicorn imports :func:`app_from_env` in each process; the configuration
travels in the ``AIOMM_SERVE_CONFIG`` environment variable (JSON). uvicorn drains in-flight
requests on SIGTERM (``timeout_graceful_shutdown``) and then runs the lifespan's shutdown, which
closes the engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from starlette.applications import Starlette

from aiomm.logging import configure_logging

from .app import ServerConfig, create_app
from .http_protocol import RenderHttpProtocol
from .render import RenderLimits

__all__ = ("app_from_env", "prefer_small_pages", "serve")

_ENV = "AIOMM_SERVE_CONFIG"


def _to_env(config: ServerConfig) -> str:
    data = asdict(config)
    data.pop("engine")
    return json.dumps(data)


def _from_env(text: str) -> ServerConfig:
    data: dict[str, Any] = json.loads(text)
    data["limits"] = RenderLimits(**data["limits"])
    data["served_model_names"] = tuple(data["served_model_names"])
    return ServerConfig(**data)


def app_from_env() -> Starlette:
    """The app of a worker process (its config from ``AIOMM_SERVE_CONFIG``)."""
    configure_logging(level="INFO", json=True)
    return create_app(_from_env(os.environ[_ENV]))


def prefer_small_pages() -> None:
    """Stop numpy from asking for transparent huge pages, in this process and the workers it
    starts (which read ``NUMPY_MADVISE_HUGEPAGE`` when they import numpy).

    numpy advises huge pages for every array of 4 MiB or more. The server makes a few such
    arrays per large image (patch rows, pixels), fills each once and drops or caches it, so each
    huge-page fault zero-fills 2 MiB of memory the kernel had to find as a free 2 MiB block.
    Measured under the render benchmark's load: kernel CPU 0.60 -> 0.39 of the 2 cores, CPU per
    image 4-10% lower (``bench/RESULTS.md``).
    """
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        try:
            from numpy.core.multiarray import _set_madvise_hugepage  # numpy 1.x
        except ImportError:  # gone from a later numpy: its arrays keep its default
            return
    _set_madvise_hugepage(False)


def serve(config: ServerConfig, *, host: str, port: int, workers: int = 1) -> None:
    """Serve ``config`` until SIGINT / SIGTERM (in-flight requests are drained)."""
    import uvicorn

    prefer_small_pages()

    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "uvloop",
        # httptools' C parser (h11, in pure Python, costs milliseconds per megabyte of data
        # URLs), and large bodies written outside the GIL
        "http": RenderHttpProtocol,
        "access_log": False,
        "timeout_graceful_shutdown": max(5, int(config.limits.timeout_s)),
    }
    if workers > 1:
        os.environ[_ENV] = _to_env(config)
        uvicorn.run("aiomm.server.serve:app_from_env", factory=True, workers=workers, **options)
    else:
        uvicorn.run(create_app(config), **options)
