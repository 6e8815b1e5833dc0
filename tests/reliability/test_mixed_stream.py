"""Nothing lost: a stream mixing good requests with hostile ones (bombs, slow loris, endless
bodies, refused addresses, corrupt and forged images) gives every good request output equal to a
clean run, every hostile one a typed error, and leaves no slot, byte or task behind. A
cancellation storm leaves nothing behind either."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator

import anyio
import numpy as np
import PIL.Image
import pytest
import torch
from hostile_server import HostileServer, drip, endless, fixed, gzip_bomb, head, nested_gzip

from aiomm.config import EngineConfig, FetchConfig
from aiomm.engine import Engine
from aiomm.errors import AiommError
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request, Result

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def jpeg(seed: int, h: int = 96, w: int = 128) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), h, w), "JPEG")


def png(mode: str, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


GOOD_PNG = encode(photo_like(np.random.default_rng(7), 80, 112), "PNG")
ROUTES = {
    "/good.png": fixed(200, GOOD_PNG),
    "/good-gzip.png": fixed(200, __import__("gzip").compress(jpeg(8)), Content_Encoding="gzip"),
    "/bomb": fixed(200, gzip_bomb(64 << 20), Content_Encoding="gzip"),
    "/gzip-gzip": fixed(200, nested_gzip(64 << 20, 2), Content_Encoding="gzip, gzip"),
    "/drip": drip,
    "/endless": endless,
    "/to-metadata": fixed(302, b"", Location="http://169.254.169.254/latest/"),
    "/short": lambda c, r: c.sendall(head(200, Content_Length=1000) + b"x" * 10),
}


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    with HostileServer(ROUTES).running() as server:
        yield server


def good_sources(server: HostileServer) -> list[object]:
    return [
        jpeg(1),
        "data:image/png;base64," + base64.b64encode(GOOD_PNG).decode(),
        server.url("/good.png"),
        server.url("/good-gzip.png"),
        photo_like(np.random.default_rng(3), 64, 64),  # a PIL image
        jpeg(2, 300, 200),
    ]


def hostile_sources(server: HostileServer) -> list[object]:
    forged = bytearray(png("L", (8, 8)))
    forged[16:24] = (8000).to_bytes(4, "big") * 2
    forged[29:33] = __import__("zlib").crc32(bytes(forged[12:29])).to_bytes(4, "big")
    return [
        server.url("/bomb"),
        server.url("/gzip-gzip"),
        server.url("/drip"),
        server.url("/endless"),
        server.url("/to-metadata"),
        server.url("/short"),
        "http://[::1",
        "http://a\x1b[2J/x.png",
        "http://169.254.169.254/latest/meta-data/",
        jpeg(4)[:300],  # truncated
        bytes(forged),  # 8000 x 8000 claimed in ~90 bytes
        png("1", (18000, 10000)),  # 180 Mpx of 1-bit in 23 KB: above Pillow's bomb limit
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
        b"",
    ]


CONFIG = EngineConfig(
    device="cpu",
    fetch=FetchConfig(allow_loopback=True, max_bytes=4 << 20, read_timeout=0.5, total_timeout=1.0),
)


def idle(stats) -> bool:  # type: ignore[no-untyped-def]
    return (
        all(q.in_use == 0 and q.waiting == 0 for q in stats.queues.values())
        and stats.decoded_bytes.in_use == 0
    )


async def run(processor, requests: list[Request]) -> list[Result]:  # type: ignore[no-untyped-def]
    async with Engine(processor, CONFIG) as engine:
        async with engine.stream(requests, max_in_flight=8) as results:
            out = [r async for r in results]
        stats = engine.stats()
    assert all(q.in_use == 0 and q.waiting == 0 for q in stats.queues.values()), stats.queues
    assert stats.decoded_bytes.in_use == 0
    return out


async def test_good_requests_in_a_hostile_stream_equal_a_clean_run(
    make_processor, hostile: HostileServer
) -> None:
    processor = make_processor()
    good = good_sources(hostile)
    bad = hostile_sources(hostile)
    clean = await run(
        processor, [Request(prompt=PH, images=[s], request_id=f"g{i}") for i, s in enumerate(good)]
    )
    mixed_sources = [("g", i, s) for i, s in enumerate(good)] + [
        ("b", i, s) for i, s in enumerate(bad)
    ]
    random.Random(0).shuffle(mixed_sources)
    mixed = await run(
        processor,
        [Request(prompt=PH, images=[s], request_id=f"{k}{i}") for k, i, s in mixed_sources],
    )
    by_id = {r.request_id: r for r in mixed}
    for expected in clean:
        assert expected.error is None, expected.error
        got = by_id[expected.request_id]
        assert got.error is None, (expected.request_id, got.error)
        assert got.prompt_token_ids == expected.prompt_token_ids
        assert got.item_hashes == expected.item_hashes
        for key, value in expected.mm_kwargs.items():
            assert torch.equal(got.mm_kwargs[key], value), (expected.request_id, key)
    for i in range(len(bad)):
        error = by_id[f"b{i}"].error
        assert isinstance(error, AiommError), (i, bad[i] if isinstance(bad[i], str) else "", error)
        assert error.request_id == f"b{i}" and str(error).isprintable()


async def test_cancellation_storm_leaves_nothing_behind(
    make_processor, hostile: HostileServer
) -> None:
    rng = random.Random(1)
    sources = [*good_sources(hostile), hostile.url("/drip"), hostile.url("/endless")]
    async with Engine(make_processor(), CONFIG) as engine:

        async def one(i: int) -> None:
            with anyio.move_on_after(rng.uniform(0, 0.3)):
                await engine.process_safe(
                    Request(prompt=PH, images=[sources[i % len(sources)]], request_id=f"c{i}")
                )

        async with anyio.create_task_group() as tg:
            for i in range(120):
                tg.start_soon(one, i)
        # single-flight computations a cancelled caller detached from finish in the engine's
        # task group (their result is cached); then everything is idle
        with anyio.fail_after(20):
            while not idle(stats := engine.stats()):  # noqa: ASYNC110 - polling stats
                await anyio.sleep(0.05)
        # the engine still serves after the storm
        after = await engine.process(Request(prompt=PH, images=[jpeg(1)]))
    assert after.error is None
    assert stats.requests_cancelled > 10
    assert stats.requests_started == (
        stats.requests_completed + stats.requests_failed + stats.requests_cancelled
    )
    assert stats.fetch.in_flight == 0
