"""The render benchmark's load client reads whole responses from a real server, exactly.

The client keeps only each body's length (it must not spend the cores it measures), so this
checks those lengths against httpx's reading of the same responses, errors included.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import os
import re
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import RECORDED_MODEL, LiveServer

#: the only random part of a render response (equal length, different value)
_REQUEST_ID = re.compile(rb'"request_id":"[^"]*"')
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("render_bench")


#: an engine error's message names its random request id
_ERROR_REQUEST_ID = re.compile(rb"request_id='[0-9a-f]+'")


def _unrandom(head: bytes) -> bytes:
    return _ERROR_REQUEST_ID.sub(b"request_id=''", _REQUEST_ID.sub(b'"request_id":""', head))


def _bodies(
    n: int, sizes: str, two_image_frac: float, repeat_frac: float, seed: int
) -> tuple[list[bytes], int]:
    """The benchmark's own request bodies (and image count) for the recorded model."""
    args = argparse.Namespace(
        n=n,
        sizes=sizes,
        two_image_frac=two_image_frac,
        repeat_frac=repeat_frac,
        mm_payload="tensors",
        model_folder=RECORDED_MODEL,
    )
    return _bench().build_bodies(args, seed=seed)


def test_client_reads_every_response_whole(live_server: LiveServer) -> None:
    bench = _bench()
    bodies, images = _bodies(4, "320x240,640x480", 0.5, 0.25, seed=5)
    assert images >= 4
    bodies.append(
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
        b'"image_url": {"url": "data:image/png;base64,AAAA"}}]}]}'
    )
    path = "/v1/chat/completions/render"
    expected = [httpx.post(live_server.url + path, content=b, timeout=60) for b in bodies]
    assert [r.status_code for r in expected] == [200] * 4 + [400]

    async def read_all() -> list[tuple[int, int, bytes]]:
        conn = bench._Connection("127.0.0.1", live_server.port)
        conn.buf = bytearray(64)  # smaller than a response's head: the buffer must grow
        conn.view = memoryview(conn.buf)
        try:
            return [await conn.post(path, b) for b in bodies]  # one keep-alive connection
        finally:
            conn.close()

    got = bench._run(read_all())
    for (status, size, first), want in zip(got, expected, strict=True):
        assert status == want.status_code
        assert size == len(want.content) > 0
        assert len(first) == min(300, size)
        assert _unrandom(first) == _unrandom(want.content[: len(first)])
    assert b"error" in got[-1][2]
    latencies, received = bench._run(
        bench._drive(
            live_server.url + path, bench.requests_for(live_server.url + path, bodies[:4]), 2
        )
    )
    assert len(latencies) == 4 and received == sum(len(r.content) for r in expected[:4])


def test_level_reports_the_generator_and_the_machine_idle(live_server: LiveServer) -> None:
    bench = _bench()
    bodies, images = _bodies(24, "320x240", 0.0, 0.0, seed=3)
    url = live_server.url + "/v1/chat/completions/render"
    # the server runs in this process: its CPU and the generator's are the same seconds here
    result = bench._level("aiomm", url, os.getpid(), 2, bodies, images)
    cores = os.cpu_count() or 1
    # /proc counts whole clock ticks: each reading may be off by one tick per core
    tick = (cores + 1) / bench.CLK_TCK / result.wall_s + 0.02
    assert result.images == images == 24
    assert 0 < result.client_cores <= cores + tick
    assert 0 <= result.machine_idle_cores <= cores + tick
    # idle + busy cannot exceed the machine: the server's cores include the generator's here
    assert result.server_cores_busy + result.machine_idle_cores <= cores + 2 * tick


def test_idle_seconds_are_idle_plus_iowait_in_clock_ticks() -> None:
    bench = _bench()
    line = "cpu  10 20 30 400 50 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert bench._idle_s(line) == pytest.approx(450 / bench.CLK_TCK)
    assert bench._idle_s() > 0  # this machine's own file parses


def test_combined_rows_weigh_cores_by_each_round_s_wall_time() -> None:
    bench = _bench()
    base = bench.LevelResult("aiomm", 8, 10, 15, 1.0, 15.0, 90.0, 120.0, 20.0, 0.3, 1.0, 0.3)
    slow = {"wall_s": 3.0, "images_per_s": 5.0, "p50_ms": 80.0, "p99_ms": 150.0}
    rounds = [
        dataclasses.replace(base, machine_idle_s=1.0),  # 0.3 and 1.0 cores over 1 s
        dataclasses.replace(base, **slow, machine_idle_s=0.6),  # 0.1 and 0.2 cores over 3 s
    ]
    (row,) = bench._combine(rounds)
    assert row.wall_s == 4.0 and row.images == 30
    assert row.client_cores == pytest.approx((0.3 * 1 + 0.1 * 3) / 4, abs=0.005)
    assert row.machine_idle_cores == pytest.approx((1.0 * 1 + 0.2 * 3) / 4, abs=0.005)
    assert (row.p50_ms, row.p99_ms) == (90.0, 150.0)  # the worst round's


def test_client_wakes_once_per_megabyte_of_a_body_not_per_burst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3 MiB body sent in 64 KiB bursts is read whole with a few wake-ups; a client that woke
    for every burst (``_WAKE_BYTES = 1``) needs many."""
    bench = _bench()
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB

    served: list[asyncio.Event] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await send(reader, writer)
        finally:
            served[-1].set()

    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the request's body, b"{}"
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for start in range(0, len(body), 1 << 16):
            writer.write(body[start : start + (1 << 16)])
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.close()  # after the data: the client has its whole body (or reads it before EOF)
        await writer.wait_closed()

    async def fetch() -> tuple[int, int, int]:
        served.append(asyncio.Event())
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = bench._Connection("127.0.0.1", port)
        waits = 0
        wake_at = conn._wake_at

        def counted(size: int) -> None:
            nonlocal waits
            waits += size > 1  # a wait for body bytes
            wake_at(size)

        conn._wake_at = counted
        try:
            status, size, _ = await conn.post("/", b"{}")
        finally:
            conn.close()
            await served[-1].wait()
            server.close()
            await server.wait_closed()
        assert (status, size) == (200, len(body))
        return size, waits, conn.wake_max

    _, few, wake = bench._run(fetch())
    monkeypatch.setattr(bench, "_WAKE_BYTES", 1)
    _, many, _ = bench._run(fetch())
    assert wake > 1 << 16  # more than one burst per wake-up, on any receive buffer size
    assert few <= -(-len(body) // wake) + 2 < many


def test_client_copies_a_head_not_the_body() -> None:
    """The body behind a response's head is dropped in the kernel: at most a head's read of it
    reaches the client's buffer, however much has arrived when the client wakes."""
    bench = _bench()
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        done.set()

    async def fetch() -> tuple[int, int, int]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = bench._Connection("127.0.0.1", port)
        copied = 0
        recv = conn._recv

        async def counted() -> int:
            nonlocal copied
            await asyncio.sleep(0.05)  # let the whole response arrive first
            n = await recv()
            copied += n
            return n

        conn._recv = counted
        try:
            status, size, first = await conn.post("/", b"{}")
        finally:
            conn.close()
            await done.wait()
            server.close()
            await server.wait_closed()
        assert first == body[:300]
        return status, size, copied

    status, size, copied = bench._run(fetch())
    assert (status, size) == (200, len(body))
    assert copied <= 2 * bench._HEAD_BYTES


def test_bench_compares_two_aiomm_servers_in_one_run(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--compare-flags``: a second aiomm server with other flags, in the same rounds."""
    bench = _bench()
    args = argparse.Namespace(model_folder="/m", workers=2, cache_gb=0.5)
    assert bench.aiomm_command(args, 9, ["--no-cache-pretouch"])[1:] == [
        "serve", "/m", "--port", "9", "--workers", "2", "--cache-gb", "0.5", "--no-cache-pretouch"
    ]  # fmt: skip
    out = tmp_path / "results.json"
    argv = [
        *("--model-folder", str(model_folder), "--n", "4", "--concurrency", "2", "--rounds", "1"),
        *("--cache-gb", "0.1", "--compare-flags=--no-cache-pretouch", "--json", str(out)),
        "--aiomm-flags=--no-peer-cache",
    ]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "c=2: aiomm/aiomm-b (--no-cache-pretouch) images/s x" in printed
    # each server's command is printed: the extra flags went to the right one
    commands = dict(line.split(": ", 1) for line in printed.splitlines()[:2])
    assert commands["aiomm"].endswith("--cache-gb 0.1 --no-peer-cache"), commands
    assert commands["aiomm-b"].endswith("--cache-gb 0.1 --no-cache-pretouch"), commands
    rows = json.loads(out.read_text())["combined"]
    assert sorted(r["server"] for r in rows) == ["aiomm", "aiomm-b"]
    assert all(r["images"] > 0 and r["server_cpu_ms_per_image"] > 0 for r in rows)


def test_bench_warms_each_server_with_images_no_round_measures(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--warm N``: every server first answers N requests of a plan of its own, reported apart
    from the rounds, whose images are not among the measured ones."""
    bench = _bench()
    out = tmp_path / "results.json"
    argv = [
        *("--model-folder", str(model_folder), "--n", "3", "--concurrency", "1", "2"),
        *("--rounds", "1", "--sizes", "64x48", "--warm", "5", "--json", str(out)),
    ]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (warm,) = result["warm"]
    assert (warm["server"], warm["requests"], warm["concurrency"]) == ("aiomm", 5, 2)
    assert warm["images"] >= 5 and warm["server_cpu_ms_per_image"] > 0
    assert f"warm-up aiomm: 5 requests, {warm['images']} images at c=2" in printed
    # each run's JSON line says whether it is the warm-up or a measured round
    lines = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [line["phase"] for line in lines] == ["warm"] + ["round"] * len(result["rounds"])
    assert lines[0]["requests"] == 5 and [line["requests"] for line in lines[1:]] == [
        r["requests"] for r in result["rounds"]
    ]
    # the rounds count only their own requests
    assert sorted(r["requests"] for r in result["combined"]) == [3, 3]

    args = argparse.Namespace(
        n=3, sizes="64x48", two_image_frac=0.5, repeat_frac=0.25, mm_payload="tensors",
        model_folder=str(model_folder), seed=0, warm=5,
    )  # fmt: skip
    warm_bodies, images = bench.warm_plan(args)
    assert (len(warm_bodies), images) == (5, warm["images"])

    def urls(bodies: list[bytes]) -> set[str]:
        return {
            part["image_url"]["url"]
            for body in bodies
            for part in json.loads(body)["messages"][0]["content"]
            if part["type"] == "image_url"
        }

    measured = set()
    for level in range(2):
        measured |= urls(bench.build_bodies(args, args.seed + 1000 * level)[0])
    assert measured and not urls(warm_bodies) & measured


def test_bench_refuses_a_negative_warm_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _bench().main(["--warm", "-1"])
    assert exit_info.value.code == 2
    assert "--warm must be 0 or more, got -1" in capsys.readouterr().err


def test_connections_hold_no_body_sized_buffers() -> None:
    """A level opens its connections on the clock: each holds a head's buffer, not megabytes
    (32 connections zeroing 4 MiB each took ~0.1 s of the generator at every level's start)."""
    bench = _bench()
    conns = [bench._Connection("127.0.0.1", 1) for _ in range(32)]
    assert sum(len(c.buf) for c in conns) <= 32 * 4 * bench._HEAD_BYTES < len(bench._SINK) * 2


def test_requests_are_whole_http_posts_made_before_the_clock() -> None:
    bench = _bench()
    (request,) = bench.requests_for("http://127.0.0.1:9/v1/chat/completions/render", [b"{}"])
    assert request == (
        b"POST /v1/chat/completions/render HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_drive_pauses_the_collector_and_restores_it(live_server: LiveServer, enabled: bool) -> None:
    """The generator runs without the cyclic collector (it would scan the generator's heap
    while the server is measured) and leaves it as it found it."""
    import gc

    bench = _bench()
    bodies, _ = _bodies(2, "64x48", 0.0, 0.0, seed=9)
    url = live_server.url + "/v1/chat/completions/render"
    seen: list[bool] = []

    async def drive() -> tuple[list[float], int]:
        async def watch() -> None:
            seen.append(gc.isenabled())

        task = asyncio.ensure_future(bench._drive(url, bench.requests_for(url, bodies), 2))
        await asyncio.sleep(0)  # the drive has started
        await watch()
        return await task

    (gc.enable if enabled else gc.disable)()
    try:
        latencies, received = bench._run(drive())
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen == [False] and len(latencies) == 2 and received > 0


def test_plans_made_in_a_process_pool_are_the_serial_ones(model_folder: Path) -> None:
    """The benchmark makes a plan's images on every core; the bodies are the same bytes as when
    made one by one, repeats included (the plan's draws come first, in one order)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    bench = _bench()
    args = argparse.Namespace(
        n=12, sizes="64x48,48x80", two_image_frac=0.5, repeat_frac=0.4, mm_payload="tensors",
        model_folder=str(model_folder),
    )  # fmt: skip
    serial = bench.build_bodies(args, 3)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        assert bench.build_bodies(args, 3, pool) == serial
    bodies, images = serial
    urls = [
        part["image_url"]["url"]
        for body in bodies
        for part in json.loads(body)["messages"][0]["content"]
        if part["type"] == "image_url"
    ]
    assert len(bodies) == 12 and len(urls) == images > 12
    assert 1 < len(set(urls)) < images  # new images and repeats
    assert bench.build_bodies(argparse.Namespace(**{**vars(args), "n": 0}), 3) == ([], 0)
