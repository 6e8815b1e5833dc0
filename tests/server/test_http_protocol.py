"""``RenderHttpProtocol``: large bodies written with the GIL released arrive whole and in order,
through a slow reader, a reader that drops the connection, and never in plain text over TLS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

uvicorn = pytest.importorskip("uvicorn")

from aiomm.server.runtime import protocol as http_protocol  # noqa: E402
from aiomm.server.runtime.protocol import (  # noqa: E402
    DIRECT_WRITE_BYTES,
    DirectWriteTransport,
    RenderHttpProtocol,
)

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port  # noqa: E402

_RNG = np.random.default_rng(0)
#: small and large pieces in an order that puts small writes behind queued large ones
CHUNKS = [
    b'{"head": 1, "x": "',
    _RNG.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes(),
    b"small piece",
    _RNG.integers(0, 256, 5 << 20, dtype=np.uint8).tobytes(),
    _RNG.integers(0, 256, 20 << 20, dtype=np.uint8).tobytes(),
    b'"}',
]
BODY = b"".join(CHUNKS)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    length = str(len(BODY)).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]}
    )
    for i, chunk in enumerate(CHUNKS):
        await send({"type": "http.response.body", "body": chunk, "more_body": i < len(CHUNKS) - 1})


class _Server:
    def __init__(self, loop: str, app: Any = _app, **ssl_files: str) -> None:
        self.port = free_port()
        scheme = "https" if ssl_files else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}/"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", loop=loop,
            http=RenderHttpProtocol, log_config=None, **ssl_files,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def direct_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(size asked, size written) of every write the protocol made to a socket itself."""
    calls: list[tuple[int, int]] = []

    def write(fd: int, data: Any) -> int:
        try:
            sent = os.write(fd, data)
        except OSError:
            calls.append((len(data), 0))
            raise
        calls.append((len(data), sent))
        return sent

    monkeypatch.setattr(http_protocol, "os", types.SimpleNamespace(write=write))
    yield calls


def _request(port: int, *, rcvbuf: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    return sock


def _read_response(sock: socket.socket) -> bytes:
    data = bytearray()
    while b"\r\n\r\n" not in data:
        piece = sock.recv(1 << 16)
        assert piece, "connection closed before the headers"
        data += piece
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                 .split(b":")[1])  # fmt: skip
    rest = bytearray(body)
    while len(rest) < length:
        piece = sock.recv(1 << 20)
        assert piece, "connection closed early"
        rest += piece
    return bytes(rest)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_large_writes_arrive_whole_and_in_order(
    loop: str, direct_writes: list[tuple[int, int]]
) -> None:
    with _Server(loop) as server:
        # a small receive buffer: a direct write ends partway and the transport sends the rest
        # (that later writes wait behind it is the next test's)
        sock = _request(server.port, rcvbuf=1 << 16)
        assert _read_response(sock) == BODY
        sock.close()
        # a prompt reader, on a fresh connection: the server is still fine
        assert httpx.get(server.url, timeout=30).content == BODY
    large = [c for c in direct_writes if c[0] >= DIRECT_WRITE_BYTES]
    assert large == direct_writes, "small writes stay on the transport"
    assert sum(sent for _, sent in large) > 0, "large pieces went to the socket directly"
    assert any(0 < sent < asked for asked, sent in large) or any(s == 0 for _, s in large), (
        "the slow reader left a write unfinished for the transport to complete"
    )


def _run(loop: str, main: Any) -> Any:
    """``main()`` to completion on a fresh event loop of the kind ``loop`` names."""
    if loop == "uvloop":
        import uvloop

        event_loop = uvloop.new_event_loop()
    else:
        event_loop = asyncio.new_event_loop()
    try:
        return event_loop.run_until_complete(main())
    finally:
        event_loop.close()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_write_behind_queued_bytes_waits_its_turn(
    loop: str, direct_writes: list[tuple[int, int]]
) -> None:
    first = _RNG.integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    second = _RNG.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()

    async def main() -> bytes:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            # small buffers, so that the first write cannot fit whatever the host's defaults
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 18)
            reader.connect(listener.getsockname())
            sock, _ = listener.accept()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 18)
        transport, _ = await asyncio.get_running_loop().create_connection(
            asyncio.Protocol, sock=sock
        )
        direct = DirectWriteTransport(transport)  # type: ignore[arg-type]
        received = bytearray()
        direct.write(first)  # more than the socket holds: the transport queues the rest
        assert transport.get_write_buffer_size() > 0
        # empty the socket while the loop (and so the transport's queue) stands still: the
        # socket has room, yet the next write must wait behind the queued bytes
        reader.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while piece := reader.recv(1 << 20):
                received += piece
        direct.write(second)
        reader.settimeout(30)
        while len(received) < len(first) + len(second):
            piece = await asyncio.to_thread(reader.recv, 1 << 20)
            assert piece, "connection closed early"
            received += piece
        transport.close()
        reader.close()
        return bytes(received)

    assert _run(loop, main) == first + second
    assert [asked for asked, _ in direct_writes] == [len(first)]


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_write_to_a_reset_connection_is_left_to_the_transport(
    loop: str, direct_writes: list[tuple[int, int]]
) -> None:
    class Recorder(asyncio.Protocol):
        lost: asyncio.Future[Exception | None]

        def connection_made(self, transport: Any) -> None:
            self.lost = asyncio.get_running_loop().create_future()

        def connection_lost(self, exc: Exception | None) -> None:
            self.lost.set_result(exc)

    async def main() -> Exception | None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            reader = socket.create_connection(listener.getsockname())
            sock, _ = listener.accept()
        transport, protocol = await asyncio.get_running_loop().create_connection(
            Recorder, sock=sock
        )
        # the peer resets (on loopback the reset has arrived when close returns); the loop has
        # not run since, so the transport does not know yet
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reader.close()
        DirectWriteTransport(transport).write(BODY[: 1 << 20])  # type: ignore[arg-type]
        return await asyncio.wait_for(protocol.lost, 10)

    lost = _run(loop, main)
    assert direct_writes == [(1 << 20, 0)], "the write went to the socket and failed there"
    assert isinstance(lost, ConnectionError), "the transport reported the broken connection"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_dropped_reader_leaves_the_server_serving(
    loop: str, direct_writes: list[tuple[int, int]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with _Server(loop) as server:
        sock = _request(server.port, rcvbuf=1 << 16)
        sock.recv(1 << 10)
        # close with a reset while the server is mid-body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        time.sleep(0.3)
        for _ in range(2):
            assert httpx.get(server.url, timeout=30).content == BODY
        deadline = time.monotonic() + 10
        while server.server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.server.server_state.connections, "a connection was left open"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert direct_writes, "the reset connection was written to directly"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed for the TLS test (.ci/run installs it)"
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return {"ssl_keyfile": str(key), "ssl_certfile": str(cert)}


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_tls_bodies_never_bypass_the_encryption(
    loop: str, tls_files: dict[str, str], direct_writes: list[tuple[int, int]]
) -> None:
    context = ssl.create_default_context(cafile=tls_files["ssl_certfile"])
    context.check_hostname = False
    with _Server(loop, **tls_files) as server:
        assert httpx.get(server.url, timeout=30, verify=context).content == BODY
    assert direct_writes == []


# -- request bodies ------------------------------------------------------------------------------


class _BodyRecorder:
    """An ASGI app that answers with the length of the body it read, recording each message
    ``receive`` gave it as ``(type, body length, more_body)``."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, int, bool]] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            self.messages.append((message["type"], len(chunk), message.get("more_body", False)))
            if message["type"] == "http.disconnect":
                return
            body += chunk
            if not message.get("more_body", False):
                break
        self.bodies.append(bytes(body))
        answer = str(len(body)).encode()
        headers = [(b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


def _send_in_pieces(sock: socket.socket, data: bytes, piece: int = 1 << 15) -> None:
    for start in range(0, len(data), piece):
        sock.sendall(data[start : start + piece])
        time.sleep(0.001)  # each piece its own read on the server


def _post(port: int, body: bytes, *, chunked: bool = False) -> bytes:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    with sock:
        if chunked:
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            for start in range(0, len(body), 1 << 16):
                piece = body[start : start + (1 << 16)]
                _send_in_pieces(sock, b"%x\r\n" % len(piece) + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        else:
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
            _send_in_pieces(sock, body)
        return _read_response(sock)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_body_with_its_length_reaches_the_app_whole(loop: str) -> None:
    # uvicorn alone hands a body over in ~64 KiB pieces, a trip through the loop each
    app = _BodyRecorder()
    body = _RNG.integers(0, 256, (2 << 20) + 7, dtype=np.uint8).tobytes()
    with _Server(loop, app) as server:
        assert _post(server.port, body) == str(len(body)).encode()
        assert _post(server.port, b"{}") == b"2"
    assert app.bodies == [body, b"{}"]
    assert app.messages == [("http.request", len(body), False), ("http.request", 2, False)]


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_body_without_a_length_or_above_the_bound_comes_in_pieces(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RenderHttpProtocol, "whole_body_bytes", 1 << 20)
    app = _BodyRecorder()
    large = _RNG.integers(0, 256, (1 << 20) + 1, dtype=np.uint8).tobytes()
    small = large[: 1 << 19]
    with _Server(loop, app) as server:
        assert _post(server.port, large) == str(len(large)).encode()
        assert _post(server.port, small, chunked=True) == str(len(small)).encode()
        assert _post(server.port, small) == str(len(small)).encode()
    assert app.bodies == [large, small, small]
    ends = [i for i, (_, _, more) in enumerate(app.messages) if not more]
    assert len(ends) == 3 and ends[0] > 0 and ends[1] > ends[0] + 1, app.messages
    assert ends[2] == ends[1] + 1, "a body within the bound still comes whole"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_client_leaving_mid_body_is_a_disconnect(loop: str) -> None:
    app = _BodyRecorder()
    with _Server(loop, app) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n")
        sock.sendall(b"x" * 300_000)
        time.sleep(0.2)
        sock.close()
        deadline = time.monotonic() + 10
        while not app.messages and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.messages == [("http.disconnect", 0, False)], app.messages
        assert _post(server.port, b"next") == b"4", "the server serves the next client"
    assert app.bodies == [b"next"]


class _Recording:
    """A plain transport that records its writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def test_headers_and_a_small_body_leave_in_one_write() -> None:
    async def main() -> list[list[bytes]]:
        seen = []
        recording = _Recording()
        direct = DirectWriteTransport(recording)  # type: ignore[arg-type]
        direct.write(b"HTTP/1.1 200 OK\r\n\r\n")
        direct.write(b'{"ok": true}')
        seen.append(list(recording.writes))
        # alone, a small write leaves on the loop's next turn
        direct.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert len(recording.writes) == 1
        await asyncio.sleep(0)
        seen.append(list(recording.writes))
        # a large write sends what is held first, in order; close sends what is held
        direct.write(b"head")
        direct.write(BODY[:DIRECT_WRITE_BYTES])
        direct.write(b"tail")
        direct.close()
        seen.append(recording.writes[2:])
        return seen

    joined, continued, rest = asyncio.run(main())
    assert joined == [b'HTTP/1.1 200 OK\r\n\r\n{"ok": true}']
    assert continued[1] == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert rest == [b"head", BODY[:DIRECT_WRITE_BYTES], b"tail"]
