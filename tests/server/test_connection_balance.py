"""Workers even out their keep-alive connections: a worker above its fair share closes one
connection after its next response (``Connection: close``), once per surplus connection."""

from __future__ import annotations

import importlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiomm.server.runtime import balance as connection_balance
from aiomm.server.runtime.balance import NOT_SERVING, ConnectionBalance

from .conftest import free_port

uvicorn = pytest.importorskip("uvicorn")

from aiomm.server.runtime.protocol import RenderHttpProtocol  # noqa: E402


def test_a_worker_sheds_only_its_surplus() -> None:
    counts = [NOT_SERVING, NOT_SERVING]
    mine, other = ConnectionBalance(counts, 0), ConnectionBalance(counts, 1)
    for _ in range(6):
        mine.opened()
    assert not mine.should_shed()  # not serving yet: counted, never shed
    mine.serving()
    assert counts == [6, NOT_SERVING]
    assert not mine.should_shed()  # the only worker serving holds everything
    other.serving()
    for _ in range(2):
        other.opened()
    # 6 against 2: shed while moving one narrows the gap; a shed connection stops counting
    assert [mine.should_shed() for _ in range(4)] == [True, True, True, False]
    assert counts == [3, 2]
    assert not other.should_shed()
    other.serving(False)  # stopping: its slot no longer counts
    assert counts == [3, NOT_SERVING] and not mine.should_shed()
    for _ in range(9):
        mine.released()
    assert counts[0] == 0  # never below zero


async def _app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    if scope["type"] != "http":
        return
    head = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    await send(head)  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


@pytest.fixture
def worker_with_a_peer() -> Iterator[tuple[int, list[int]]]:
    """Our protocol on loopback in a worker whose one peer holds one connection."""
    counts = [NOT_SERVING, 1]
    balance = ConnectionBalance(counts, 0)
    balance.serving()
    connection_balance.install(balance)
    port = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, http=RenderHttpProtocol,
                            lifespan="off", log_level="error")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield port, counts
    finally:
        server.should_exit = True
        thread.join(30)
        connection_balance.install(None)


def _get(sock: socket.socket) -> bytes:
    """One request on a raw connection; the response's head (its body is ``ok``)."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    return data.lower()


def test_the_surplus_connection_is_closed_after_its_response(
    worker_with_a_peer: tuple[int, list[int]],
) -> None:
    port, counts = worker_with_a_peer
    conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while counts[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counts == [3, 1]  # two more than the peer: one to move
        assert b"connection: close" in _get(conns[0])
        assert conns[0].recv(1) == b""  # the server closed it after the response
        assert counts == [2, 1]
        # the rest are within one of the peer: kept open, answered again on the same connection
        for conn in conns[1:]:
            for _ in range(2):
                assert b"connection: close" not in _get(conn)
        assert counts == [2, 1]
    finally:
        for conn in conns:
            conn.close()
    deadline = time.monotonic() + 10
    while counts[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counts == [0, 1]  # closed connections are released


def test_the_render_bench_client_reconnects_after_connection_close(
    worker_with_a_peer: tuple[int, list[int]],
) -> None:
    port, counts = worker_with_a_peer
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    render_bench = importlib.import_module("render_bench")
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    deadline = time.monotonic() + 10
    while counts[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:

        async def two_posts() -> list[tuple[int, int, bytes, bool]]:
            client = render_bench._Connection("127.0.0.1", port)
            out = []
            for _ in range(2):
                status, size, first = await client.post("/", b"{}")
                out.append((status, size, first, client.sock is None))
            client.close()
            return out

        # two idle connections and the client's against the peer's one: the client's is shed
        results = render_bench._run(two_posts())
    finally:
        for conn in idle:
            conn.close()
    assert [r[:3] for r in results] == [(200, 2, b"ok")] * 2
    assert [r[3] for r in results] == [True, True]  # closed after each: a new connection each
