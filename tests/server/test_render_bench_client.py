"""The render benchmark's load client reads whole responses from a real server, exactly.

The client keeps only each body's length (it must not spend the cores it measures), so this
checks those lengths against httpx's reading of the same responses, errors included.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

import httpx

from .conftest import RECORDED_MODEL, LiveServer

#: the only random part of a render response (equal length, different value)
_REQUEST_ID = re.compile(rb'"request_id":"[^"]*"')
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("render_bench")


def _unrandom(head: bytes) -> bytes:
    return _REQUEST_ID.sub(b'"request_id":""', head)


def test_client_reads_every_response_whole(live_server: LiveServer) -> None:
    bench = _bench()
    args = argparse.Namespace(
        n=4,
        sizes="320x240,640x480",
        two_image_frac=0.5,
        repeat_frac=0.25,
        mm_payload="tensors",
        model_folder=RECORDED_MODEL,
    )
    bodies, images = bench.build_bodies(args, seed=5)
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
    latencies, received = bench._run(bench._drive(live_server.url + path, bodies[:4], 2))
    assert len(latencies) == 4 and received == sum(len(r.content) for r in expected[:4])
