"""API keys, as vLLM 0.33's ``--api-key`` / ``VLLM_API_KEY`` check them: a pure ASGI middleware
that answers 401 ``{"error":"Unauthorized"}`` to a request under ``/v1``, ``/v2``,
``/inference`` or ``/cohere`` without ``Authorization: Bearer <one of the keys>``.

Exactly vLLM's rule (``vllm/entrypoints/serve/middleware/authenticate.py``): the path is matched
by prefix after the mount's ``root_path`` is removed (so ``/v10`` and unknown ``/v1/...`` paths
answer 401 before 404); the scheme is case-insensitive, the token is everything after the first
space; ``OPTIONS`` (CORS preflights) and every other path (``/health``, ``/ready``, ``/metrics``,
``/tokenize``) stay open. Tokens are compared as SHA-256 digests with
:func:`secrets.compare_digest` against every key, so the time taken tells nothing about the keys
(their length included). Keys never reach a log, an error or a metric.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable, Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

__all__ = (
    "API_KEY_ENV",
    "GUARDED_PREFIXES",
    "UNAUTHORIZED_BODY",
    "UPSTREAM_API_KEY_ENV",
    "ApiKeyMiddleware",
    "api_keys",
    "upstream_api_key",
)

#: the paths vLLM 0.33 guards (matched with ``str.startswith``, as vLLM does)
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: vLLM's answer to a missing or wrong key, byte for byte (status 401, no ``WWW-Authenticate``)
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
#: the variable vLLM reads its key from when ``--api-key`` is not given (one key: no separator)
API_KEY_ENV = "VLLM_API_KEY"
#: the variable ``aiomm serve`` reads the upstream engine's key from (``--upstream-api-key``)
UPSTREAM_API_KEY_ENV = "AIOMM_UPSTREAM_API_KEY"


def api_keys(given: Sequence[str] | None, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys a server takes, as vLLM picks them: ``given`` (``--api-key``) when not empty, else
    :data:`API_KEY_ENV`; empty strings dropped (so ``VLLM_API_KEY=""`` means no key)."""
    env = os.environ if environ is None else environ
    candidates: Sequence[str | None] = given or [env.get(API_KEY_ENV)]
    return tuple(k for k in candidates if k)


def upstream_api_key(given: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The key sent to the upstream engine: ``given`` (``--upstream-api-key``), else
    :data:`UPSTREAM_API_KEY_ENV`; None when neither is set or both are empty."""
    env = os.environ if environ is None else environ
    return given or env.get(UPSTREAM_API_KEY_ENV) or None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class ApiKeyMiddleware:
    """Answer 401 to a guarded request without one of ``keys`` as its Bearer token (see the
    module docstring); pass everything else to ``app``.

    :raises ValueError: ``keys`` is empty (the app would be closed to everyone).
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self._digests = [_digest(k) for k in keys]
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")

    def __repr__(self) -> str:
        return f"ApiKeyMiddleware(keys={len(self._digests)})"

    def authorized(self, headers: Headers) -> bool:
        """Whether ``headers`` hold ``Authorization: Bearer <key>`` for one of the keys."""
        value = headers.get("authorization")
        if not value:
            return False
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = _digest(token)
        match = False
        for known in self._digests:  # every key, always: no early exit
            match |= secrets.compare_digest(digest, known)
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if not path.startswith(GUARDED_PREFIXES) or self.authorized(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":  # refused before the handshake (1008: policy violation)
            await WebSocketClose(code=1008)(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-length", str(len(UNAUTHORIZED_BODY)).encode()),
                    (b"content-type", b"application/json"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})
