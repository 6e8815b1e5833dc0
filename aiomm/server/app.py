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
with orjson (:mod:`.endpoint`); bad input is a 4xx OpenAI error body and never disturbs other
requests; a client that disconnects cancels its request's work.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware

from aiomm.server.auth import ApiKeyMiddleware
from aiomm.server.config import ENCODE_ON_SEND_CORES, ServerConfig, encode_on_send
from aiomm.server.routes import Routes
from aiomm.server.state import StateHolder, model_folder, open_state

__all__ = (
    "ENCODE_ON_SEND_CORES",
    "ServerConfig",
    "create_app",
    "encode_on_send",
    "model_folder",
    "open_state",
)


def create_app(config: ServerConfig) -> Starlette:
    """The ASGI app for ``config`` (see the module docstring): its lifespan opens the state
    (:func:`open_state`), its routes (:class:`~aiomm.server.routes.Routes`) read it."""
    holder = StateHolder()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with open_state(config) as state:
            holder.current = state
            try:
                yield
            finally:
                holder.current = None

    middleware = [Middleware(ApiKeyMiddleware, keys=config.api_keys)] if config.api_keys else []
    return Starlette(
        routes=Routes(config, holder).routes(), middleware=middleware, lifespan=lifespan
    )
