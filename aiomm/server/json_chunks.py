"""JSON documents with multi-megabyte string values sent without being copied together.

A render response carries one base64 string of several megabytes per image. Building it as one
``bytes`` object costs two full copies (quoting the string, then the document), all on the event
loop. Here such a value is a :class:`PiecesString` (the pieces the item encoder made in a worker
thread); :func:`dumps_chunks` writes the small rest of the document with orjson and splices the
pieces in, and :class:`ChunkedJSONResponse` sends the chunks one by one with a
``Content-Length``, so the bytes on the wire equal ``orjson.dumps`` of the plain document.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ("ChunkedJSONResponse", "PiecesString", "dumps", "dumps_chunks", "plain")

#: chunks below this size are merged with their neighbours before they are sent
_MERGE_BYTES = 1 << 16
#: a per-process random token standing for a spliced value in the skeleton (unguessable, so no
#: client string echoed into a response can forge one)
_MARK = secrets.token_hex(16).encode()
_MARK_FRAGMENT = orjson.Fragment(b'"' + _MARK + b'"')


class PiecesString:
    """A JSON string value given as ASCII pieces that need no escaping (base64)."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        self.nbytes = sum(len(p) for p in self.pieces)

    def __str__(self) -> str:
        return b"".join(self.pieces).decode("ascii")


def _default(found: list[PiecesString]) -> Any:
    def default(obj: Any) -> Any:
        if isinstance(obj, PiecesString):
            found.append(obj)
            return _MARK_FRAGMENT
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")

    return default


def dumps_chunks(obj: Any) -> list[bytes]:
    """``obj`` as JSON in chunks (each :class:`PiecesString` spliced in, not copied)."""
    found: list[PiecesString] = []
    skeleton = orjson.dumps(obj, default=_default(found))
    if not found:
        return [skeleton]
    parts = skeleton.split(_MARK)
    chunks: list[bytes] = []
    small = bytearray(parts[0])
    for value, after in zip(found, parts[1:], strict=True):
        for piece in value.pieces:
            if len(piece) < _MERGE_BYTES:
                small += piece
                continue
            if small:
                chunks.append(bytes(small))
                small = bytearray()
            chunks.append(piece)
        small += after
    chunks.append(bytes(small))
    return chunks


def dumps(obj: Any) -> bytes:
    """``obj`` as one JSON ``bytes`` (for small documents and clients that need one buffer)."""
    return b"".join(dumps_chunks(obj))


def plain(obj: Any) -> Any:
    """``obj`` with every :class:`PiecesString` turned into a ``str`` (for Python callers)."""
    if isinstance(obj, PiecesString):
        return str(obj)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


class ChunkedJSONResponse(Response):
    """A JSON response sent as the chunks of :func:`dumps_chunks` (one ASGI body message each,
    with ``Content-Length``: no chunked transfer encoding, no joined copy)."""

    media_type = "application/json"

    def __init__(
        self, chunks: list[bytes], status_code: int = 200, background: BackgroundTask | None = None
    ) -> None:
        if not chunks:  # the last chunk ends the body: without one the response never ends
            raise ValueError("a chunked JSON response needs at least one chunk")
        self.chunks = chunks
        self.body_length = sum(len(c) for c in chunks)
        self.status_code = status_code
        self.background = background
        self.body = b""
        self.init_headers({"content-length": str(self.body_length)})

    def init_headers(self, headers: Any = None) -> None:
        raw = [(b"content-type", b"application/json")]
        for key, value in (headers or {}).items():
            raw.append((key.encode("latin-1"), value.encode("latin-1")))
        self.raw_headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        last = len(self.chunks) - 1
        for i, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < last})
        if self.background is not None:
            await self.background()
