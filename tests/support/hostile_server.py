"""A hostile HTTP server on loopback: raw sockets, so every byte of a response is the test's.

Each route is a function ``(conn, release) -> None`` writing whatever it likes to the socket;
``release`` is set at teardown so routes that stall return at once.
"""

from __future__ import annotations

import gzip
import socket
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Route = Callable[[socket.socket, threading.Event], None]


def head(status: int = 200, **headers: str | int) -> bytes:
    lines = [f"HTTP/1.1 {status} X"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def gzip_bomb(inflated: int) -> bytes:
    """A gzip body of ``inflated`` zero bytes (about 1000:1)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    parts = [comp.compress(block) for _ in range(inflated >> 20)]
    parts.append(comp.compress(bytes(inflated & ((1 << 20) - 1))))
    parts.append(comp.flush())
    return b"".join(parts)


def nested_gzip(inflated: int, layers: int) -> bytes:
    """``layers`` gzip layers around ``inflated`` zero bytes: a few hundred bytes on the wire."""
    body = gzip_bomb(inflated)
    for _ in range(layers - 1):
        body = gzip.compress(body, 9)
    return body


def fixed(status: int, body: bytes, **headers: str | int) -> Route:
    """A complete response with an exact Content-Length (unless ``headers`` names another).

    The server answers one request per connection, so it says ``Connection: close``: without it
    a client may send its next request on the connection just as the server closes it, and get a
    reset (a flaky failure of a good request, not a hostile route)."""
    headers.setdefault("Content_Length", len(body))
    headers.setdefault("Connection", "close")

    def route(conn: socket.socket, release: threading.Event) -> None:
        conn.sendall(head(status, **headers) + body)

    return route


def drip(conn: socket.socket, release: threading.Event) -> None:
    """Slow loris: a header byte at a time, each within the read timeout."""
    for byte in head(200, Content_Length=10):
        if release.wait(0.2):
            return
        conn.sendall(bytes([byte]))


def endless(conn: socket.socket, release: threading.Event) -> None:
    """A chunked body that never ends (until the server is closed)."""
    conn.sendall(head(200, Transfer_Encoding="chunked"))
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"e" * (1 << 16))
    while not release.is_set():
        conn.sendall(chunk)


class HostileServer:
    """Serves ``routes`` (path -> Route) on 127.0.0.1, one thread per connection."""

    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        self.release = threading.Event()
        self.hits: dict[str, int] = {}
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._threads: list[threading.Thread] = []

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def _serve(self) -> None:
        while not self.release.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(4096)
                    if not more:
                        return
                    data += more
                path = data.split(b" ", 2)[1].decode()
                self.hits[path] = self.hits.get(path, 0) + 1
                route = self.routes.get(path, fixed(404, b"not found"))
                route(conn, self.release)
            except OSError:
                pass  # the client gave up: what the test wanted

    @contextmanager
    def running(self) -> Iterator[HostileServer]:
        self._thread.start()
        try:
            yield self
        finally:
            self.release.set()
            self._thread.join(5)
            self._sock.close()
            for t in self._threads:
                t.join(5)
