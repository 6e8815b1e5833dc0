"""JSON documents with multi-megabyte string values sent without being copied together.

A render response carries one base64 string of several megabytes per image. Building it as one
``bytes`` object costs two full copies (quoting the string, then the document), all on the event
loop. Here such a value is a :class:`PiecesString` (pieces from the item encoder, made already or
made as they are read); :func:`dumps_chunks` writes the small rest of the document with orjson
and splices the values in, and :class:`ChunkedJSONResponse` sends the chunks one by one with a
``Content-Length``, so the bytes on the wire equal ``orjson.dumps`` of the plain document.

A value whose pieces are made as they are read (:class:`~.kwargs_codec.ItemB64`) is encoded by
the response while it sends: each piece goes to the socket right after it is made, still in the
core's cache. Made all at once before the response, a 7 MB item's pieces had left the cache by
the time they were sent (base64 into cold memory, then the kernel's copy from it).
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.lowlevel
import orjson
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from aiomm.errors import first_error
from aiomm.server.disconnect import until_disconnect
from aiomm.vllm.wire import PiecesString

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = (
    "ChunkedJSONResponse",
    "dumps",
    "dumps_chunks",
    "iter_chunks",
    "plain",
)

#: chunks below this size are merged with their neighbours before they are sent
_MERGE_BYTES = 1 << 16
#: a response lets the event loop run its other tasks after about this many bytes
_CHECKPOINT_BYTES = 4 << 20
#: a per-process random token standing for a spliced value in the skeleton (unguessable, so no
#: client string echoed into a response can forge one)
_MARK = secrets.token_hex(16).encode()
_MARK_FRAGMENT = orjson.Fragment(b'"' + _MARK + b'"')


def _default(found: list[PiecesString]) -> Any:
    def default(obj: Any) -> Any:
        if isinstance(obj, PiecesString):
            found.append(obj)
            return _MARK_FRAGMENT
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")

    return default


def dumps_chunks(obj: Any) -> list[bytes | PiecesString]:
    """``obj`` as JSON in chunks: the document's own bytes, with each :class:`PiecesString`
    a chunk of its own between them (spliced in, not copied; its pieces are made, if they are
    made as they are read, when the chunks are)."""
    found: list[PiecesString] = []
    skeleton = orjson.dumps(obj, default=_default(found))
    if not found:
        return [skeleton]
    parts = skeleton.split(_MARK)
    chunks: list[bytes | PiecesString] = [parts[0]]
    for value, after in zip(found, parts[1:], strict=True):
        chunks += (value, after)
    return chunks


def iter_chunks(chunks: Iterable[bytes | PiecesString]) -> Iterable[bytes]:
    """The bytes of :func:`dumps_chunks`' chunks, in order (a value's pieces made here)."""
    for chunk in chunks:
        if isinstance(chunk, PiecesString):
            yield from chunk.pieces
        else:
            yield chunk


def dumps(obj: Any) -> bytes:
    """``obj`` as one JSON ``bytes`` (for small documents and clients that need one buffer)."""
    return b"".join(iter_chunks(dumps_chunks(obj)))


def plain(obj: Any) -> Any:
    """``obj`` with every :class:`PiecesString` turned into a ``str`` (for Python callers)."""
    if isinstance(obj, PiecesString):
        return str(obj)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def _merged(pieces: Iterable[bytes]) -> Iterable[bytes]:
    """``pieces`` with runs of small ones joined (one send each costs a write)."""
    small = bytearray()
    for piece in pieces:
        if len(piece) < _MERGE_BYTES:
            small += piece
            continue
        if small:
            yield bytes(small)
            small = bytearray()
        yield piece
    if small:
        yield bytes(small)


class ChunkedJSONResponse(Response):
    """A JSON response sent as the chunks of :func:`dumps_chunks` (an ASGI body message per
    large piece, small ones merged, with ``Content-Length``: no chunked transfer encoding, no
    joined copy)."""

    media_type = "application/json"

    def __init__(
        self,
        chunks: list[bytes | PiecesString],
        status_code: int = 200,
        background: BackgroundTask | None = None,
    ) -> None:
        if not chunks:  # the last chunk ends the body: without one the response never ends
            raise ValueError("a chunked JSON response needs at least one chunk")
        self.chunks = chunks
        self.body_length = sum(c.nbytes if isinstance(c, PiecesString) else len(c) for c in chunks)
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
        if not any(isinstance(c, PiecesString) and c.made_when_read for c in self.chunks):
            await self._send_body(send)
        else:
            # the rest is made as it is sent: a client that leaves stops the making (a server's
            # send after a disconnect returns as if it had sent)
            try:
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        await until_disconnect(receive)
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    await self._send_body(send)
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:  # the body's own error, as the server logs it
                raise first_error(group, Exception) from None
        if self.background is not None:
            await self.background()

    async def _send_body(self, send: Send) -> None:
        sent = since_checkpoint = 0
        for piece in _merged(iter_chunks(self.chunks)):
            sent += len(piece)
            # the Content-Length is sent: a value that made other bytes must not end as a
            # well-formed response
            if sent > self.body_length:
                raise RuntimeError(f"the body outgrew its Content-Length {self.body_length}")
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            since_checkpoint += len(piece)
            if since_checkpoint >= _CHECKPOINT_BYTES:
                # a send to a socket with room does not yield: let the loop's other tasks run
                since_checkpoint = 0
                await anyio.lowlevel.checkpoint()
        if sent != self.body_length:
            raise RuntimeError(f"a body of {sent} bytes for Content-Length {self.body_length}")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
