"""uvicorn's httptools protocol, writing large response bodies with the GIL released.

uvloop's ``transport.write`` copies into the socket while holding the GIL. A render response
carries megabytes of base64 per image, and py-spy (``--gil``) put about a third of the GIL's
held time under load in those copies, on the event loop thread, while the transform threads
waited for the GIL. ``os.write`` on the same non-blocking socket releases the GIL around the
copy. So a large write that finds nothing queued in the transport goes to the socket directly;
what does not fit is handed to the transport, which queues it and keeps every later write
behind it, so the bytes stay in order. Small writes, any write behind queued data, and every
transport not known to write its bytes to the socket unchanged (TLS, proxies) take the
transport's own path. A small write (a response's status line and headers) waits for the next
one until the loop's next turn: a response with a small body leaves in one send instead of two
(each send on loopback also costs the kernel's delivery to the client).

Request bodies go the other way: uvicorn hands the app a body in pieces of about 64 KiB, pausing
the socket after each one until the app has taken it, so a request with megabytes of data URLs
costs a trip through the event loop (and a copy) per piece. A body whose ``Content-Length`` is
at most :attr:`RenderHttpProtocol.whole_body_bytes` is read whole first, and the app is woken
once, for all of it. Its pieces are kept as the parser hands them over and joined once, into the
``bytes`` the app receives: uvicorn's own ``bytearray`` grows by reallocation and is then copied
again into ``bytes``, two or three copies of every request's megabytes on the event loop.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aiomm.server.runtime import balance as connection_balance
from aiomm.server.runtime.balance import ConnectionBalance

__all__ = ("DIRECT_WRITE_BYTES", "HELD_WRITE_BYTES", "DirectWriteTransport", "RenderHttpProtocol")

#: writes from this size on go to the socket with the GIL released (the response writer sends
#: base64 in pieces of at least 64 KiB; headers and small bodies stay on the transport)
DIRECT_WRITE_BYTES = 1 << 16
#: writes below this size wait for the next write until the loop's next turn (a response's
#: status line and headers, then its body: one send, one segment on the wire)
HELD_WRITE_BYTES = 1 << 14
#: (module, class) of the transports that write the bytes they are given to their socket as they
#: are: uvloop's and asyncio's plain socket transports (asyncio's ``sock.send`` releases the
#: GIL already; it is here so that both loops behave alike)
_PLAIN_TRANSPORTS = frozenset(
    {
        ("uvloop.loop", "TCPTransport"),
        ("uvloop.loop", "UnixTransport"),
        ("asyncio.selector_events", "_SelectorSocketTransport"),
    }
)


class DirectWriteTransport:
    """A transport whose large writes go straight to its socket when nothing is queued, and
    whose small writes wait for the next one until the loop's next turn (a response's headers
    and a small body leave in one send); everything else is the wrapped transport's."""

    __slots__ = ("_fd", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        #: a small write not sent yet: joined with the next write, else sent on the loop's
        #: next turn (:meth:`_flush`), or before the transport closes
        self._held: bytes | None = None
        kind = (type(transport).__module__, type(transport).__qualname__)
        sock = transport.get_extra_info("socket")
        # a TLS transport's socket carries ciphertext: never write plain bytes to it
        plain = kind in _PLAIN_TRANSPORTS and transport.get_extra_info("sslcontext") is None
        self._fd = int(sock.fileno()) if plain and sock is not None else -1

    def __getattr__(self, name: str) -> Any:
        if name == "_transport":  # unset (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self._transport, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` after everything written before it."""
        transport = self._transport
        if not isinstance(data, bytes | bytearray):
            data = memoryview(data).cast("B")  # lengths and offsets below count bytes
        held = self._held
        if held is not None:
            self._held = None
            if len(data) < DIRECT_WRITE_BYTES:
                data = held + data  # one send for both (a copy of a small write)
            else:
                transport.write(held)
        elif len(data) < HELD_WRITE_BYTES and not transport.is_closing():
            # a response's headers: its body usually follows in the same turn of the loop
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self._flush)
            return
        if (
            self._fd >= 0
            and len(data) >= DIRECT_WRITE_BYTES
            and transport.get_write_buffer_size() == 0
            and not transport.is_closing()
        ):
            try:
                sent = os.write(self._fd, data)
            except OSError:
                # a full socket, or a broken connection the transport reports in its own way
                sent = 0
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        """Send what is held, then close the transport (it sends what it queued first)."""
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()


class RenderHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`DirectWriteTransport`; in a worker of
    several, a worker two or more connections ahead of the least loaded one closes a connection
    after its next response (:mod:`.balance`)."""

    _balance: ConnectionBalance | None = None
    #: a request body of at most this many bytes (by its ``Content-Length``) is read whole
    #: before the app is woken for it
    whole_body_bytes = 64 << 20
    #: the body now being read whole (0: uvicorn's pieces)
    _whole_body = 0
    #: its pieces so far
    _pieces: list[bytes]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(DirectWriteTransport(transport))  # type: ignore[arg-type]
        self._balance = connection_balance.current()
        if self._balance is not None:
            self._balance.opened()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._balance is not None:
            self._balance.released()
            self._balance = None
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._whole_body = _content_length(self.headers, self.whole_body_bytes)
        self._pieces = []
        cycle = self.cycle
        if (
            self._balance is not None
            and cycle is not None
            and cycle.keep_alive
            and self._balance.should_shed()
        ):
            cycle.keep_alive = False  # "Connection: close" on the response, then closed
            self._balance = None  # no longer counted here

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if not self._whole_body or cycle is None:
            super().on_body(body)
            return
        if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return  # as uvicorn's: a body after the response, or of an upgrade, is dropped
        # no pause and no wake-up per piece: on_message_complete wakes the app for the whole body
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        if self._whole_body:  # set with _pieces, in on_headers_complete
            cycle, pieces, self._pieces = self.cycle, self._pieces, []
            if cycle is not None and pieces:
                # one copy (none for one piece); uvicorn's receive() hands bytes on as they are
                cycle.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # type: ignore[assignment]
        super().on_message_complete()


def _content_length(headers: list[tuple[bytes, bytes]], most: int) -> int:
    """The request's ``Content-Length`` when it is a number from 1 to ``most``, else 0."""
    for name, value in headers:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return 0
            return length if 0 < length <= most else 0
    return 0
