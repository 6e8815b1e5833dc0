"""Fixtures of the media tests: a real loopback HTTP server and a guard on outgoing connections."""

from __future__ import annotations

import http.server
import io
import ipaddress
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import numpy as np
import PIL.Image
import pytest


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PIL.Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


#: the body of /ok.png: a 6 x 5 RGB gradient
OK_PNG = png_bytes(np.arange(5 * 6 * 3, dtype=np.uint8).reshape(5, 6, 3))


class LoopbackServer(http.server.ThreadingHTTPServer):
    """Serves the test routes on 127.0.0.1; counts hits per path and keeps request headers."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hits: Counter[str] = Counter()
        self.headers_seen: list[dict[str, str]] = []
        #: set at teardown so handlers that stall (slow routes) return at once
        self.release = threading.Event()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LoopbackServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        self.server.hits[parts.path] += 1
        self.server.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        try:
            self._route(parts.path, parse_qs(parts.query))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (size cap, timeout): what the test wanted

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self._send(302, headers={"Location": location})

    def _route(self, path: str, query: dict[str, list[str]]) -> None:
        release = self.server.release
        segments = path.strip("/").split("/")
        if path == "/ok.png":
            self._send(200, OK_PNG, {"Content-Type": "image/png"})
        elif path == "/slow":  # nothing at all until long after the read timeout
            release.wait(5)
            self._send(200, OK_PNG)
        elif path == "/drip":  # one byte every 0.1 s: never a read timeout, but slow overall
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                if release.wait(0.1):
                    break
                self.wfile.write(b"x")
                self.wfile.flush()
        elif path == "/big-declared":  # claims 1 GB, sends 100 bytes, then stalls
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.write(b"x" * 100)
            self.wfile.flush()
            release.wait(5)
        elif path == "/big-chunked":  # chunked, no Content-Length, up to 64 MB
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"y" * 4096
            for _ in range(16384):
                if release.is_set():
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        elif segments[0] == "bytes":  # /bytes/N: exactly N bytes with Content-Length
            self._send(200, b"z" * int(segments[1]))
        elif segments[0] == "chunked":  # /chunked/N: exactly N bytes, chunked
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            body = b"z" * int(segments[1])
            for i in range(0, len(body), 300):
                piece = body[i : i + 300]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/redirect":
            self._redirect("/ok.png")
        elif segments[0] == "redirect-chain":  # /redirect-chain/N: N more redirects to /ok.png
            n = int(segments[1])
            self._redirect(f"/redirect-chain/{n - 1}" if n > 1 else "/ok.png")
        elif path == "/redirect-to":
            self._redirect(query["url"][0])
        elif segments[0] == "status":
            self._send(int(segments[1]), b"status body")
        elif path == "/set-cookie":
            self._send(200, OK_PNG, {"Set-Cookie": "session=secret; Path=/"})
        else:
            self._send(404, b"not found")


@pytest.fixture
def ok_png() -> bytes:
    """The body of /ok.png."""
    return OK_PNG


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    srv = LoopbackServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02})
    thread.daemon = True
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
        thread.join(5)


@pytest.fixture(autouse=True)
def connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every TCP connect the code under test makes; any non-loopback target fails the test.

    httpcore connects through ``anyio.connect_tcp``; the fetcher must always hand it the IP
    address it checked, never a host name (which would be resolved again).
    """
    attempts: list[str] = []
    real_connect = anyio.connect_tcp

    async def guarded_connect(remote_host: Any, remote_port: int, **kwargs: Any) -> Any:
        attempts.append(str(remote_host))
        try:
            address = ipaddress.ip_address(str(remote_host))
        except ValueError:
            raise AssertionError(f"connect got host name {remote_host!r}, not an IP") from None
        if not address.is_loopback:
            raise AssertionError(f"the test tried to connect to {address}")
        return await real_connect(remote_host, remote_port, **kwargs)

    monkeypatch.setattr(anyio, "connect_tcp", guarded_connect)
    return attempts


@pytest.fixture
def elapsed() -> Any:
    """``with elapsed() as t: ...`` then ``t.seconds``."""

    class Timer:
        seconds = 0.0

        def __enter__(self) -> Timer:
            self._start = time.perf_counter()
            return self

        def __exit__(self, *exc: object) -> None:
            self.seconds = time.perf_counter() - self._start

    return Timer
