"""The reliability runs too long for CI: hostile traffic, overload, cancellation, soak, restarts.

``python bench/reliability.py [--quick]`` runs, in one process, on loopback only:

1. **hostile mix**: a stream where a third of the requests are hostile (compressed bombs, slow
   loris, endless bodies, refused addresses, forged and corrupt images); every good request's
   output is compared with a clean run of the good requests alone.
2. **overload**: the capacity measured closed loop, then open-loop arrivals at 2x and 5x it (four
   in five inline images, one in five a slow download): served, shed (OverloadedError), latency of
   the inline requests, memory.
3. **cancellation storm**: requests cancelled at random moments; the engine must end idle.
4. **soak**: >= 10,000 requests through one stream, RSS at start, middle and end.
5. **restarts**: engines opened and closed in turn, RSS after each batch.
6. **fuzz**: atheris, coverage-guided, on decode for a fixed time (when ``aiomm[fuzz]`` is
   installed).

Each prints its figures; README's "Reliability" section holds a run's output.
"""

from __future__ import annotations

import argparse
import base64
import gc
import gzip
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import anyio
import numpy as np
import torch

SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

from hostile_server import HostileServer, drip, endless, fixed, gzip_bomb, head, nested_gzip  # noqa: E402

from aiomm import Engine, EngineConfig, FetchConfig, OverloadedError, Request  # noqa: E402
from aiomm.adapters import build_processor  # noqa: E402
from aiomm.errors import AiommError  # noqa: E402
from aiomm.media.samples import encode, photo_like  # noqa: E402

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def jpeg(seed: int, h: int = 96, w: int = 128) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), h, w), "JPEG")


GOOD_PNG = encode(photo_like(np.random.default_rng(7), 80, 112), "PNG")
ROUTES = {
    "/good.png": fixed(200, GOOD_PNG),
    "/good-gzip.jpg": fixed(200, gzip.compress(jpeg(8)), Content_Encoding="gzip"),
    "/bomb": fixed(200, gzip_bomb(256 << 20), Content_Encoding="gzip"),
    "/gzip-gzip": fixed(200, nested_gzip(256 << 20, 2), Content_Encoding="gzip, gzip"),
    "/triple": fixed(200, nested_gzip(256 << 20, 3), Content_Encoding="gzip, gzip, gzip"),
    "/br": fixed(200, b"x" * 100, Content_Encoding="br"),
    "/drip": drip,
    "/endless": endless,
    "/short": lambda c, r: c.sendall(head(200, Content_Length=1000) + b"x" * 10),
    "/to-metadata": fixed(302, b"", Location="http://169.254.169.254/latest/"),
    "/to-mapped": fixed(302, b"", Location="http://[::ffff:10.0.0.1]/"),
    "/loop": fixed(302, b"", Location="/loop"),
}


def _png_header_bomb(side: int) -> bytes:
    import io

    import PIL.Image

    buf = io.BytesIO()
    PIL.Image.new("L", (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = side.to_bytes(4, "big") * 2
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


def _one_bit_png(w: int, h: int) -> bytes:
    import io

    import PIL.Image

    buf = io.BytesIO()
    PIL.Image.new("1", (w, h)).save(buf, format="PNG")
    return buf.getvalue()


def hostile_sources(server: HostileServer) -> list[object]:
    port = server.port
    return [
        *(server.url(p) for p in ROUTES if not p.startswith("/good")),
        "http://[::1",
        "http://a\x1b[2J/x.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://168.63.129.16/",
        # private and metadata spellings: refused before connecting (loopback is allowed here)
        f"http://[::ffff:0:169.254.169.254]:{port}/",
        f"http://[64:ff9b:1::a00:1]:{port}/",
        f"http://[::10.0.0.1]:{port}/",
        f"http://0xa9fea9fe:{port}/",
        f"http://2852039166:{port}/",
        "file:///etc/passwd",
        jpeg(4)[:300],
        _png_header_bomb(8000),
        _one_bit_png(8192, 6000),
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
        b"\x89PNG\r\n\x1a\n" + os.urandom(200),
        b"",
    ]


def good_sources(server: HostileServer, n: int) -> list[object]:
    fixed_ones: list[object] = [
        "data:image/png;base64," + base64.b64encode(GOOD_PNG).decode(),
        server.url("/good.png"),
        server.url("/good-gzip.jpg"),
        photo_like(np.random.default_rng(3), 64, 64),
    ]
    return [*fixed_ones, *(jpeg(100 + i) for i in range(max(n - len(fixed_ones), 0)))]


def fetch_config(total_timeout: float = 1.0) -> FetchConfig:
    return FetchConfig(
        allow_loopback=True, max_bytes=4 << 20, read_timeout=0.5, total_timeout=total_timeout
    )


# -- 1. hostile mix ------------------------------------------------------------------------------


async def hostile_mix(processor, server: HostileServer, n: int) -> None:  # type: ignore[no-untyped-def]
    good = good_sources(server, 2 * n // 3)
    bad = hostile_sources(server)
    bad_n = n - len(good)
    config = EngineConfig(device="cpu", fetch=fetch_config())

    async def run(items: list[tuple[str, object]]) -> dict[str, object]:
        async with Engine(processor, config) as engine:
            reqs = [Request(prompt=PH, images=[s], request_id=rid) for rid, s in items]
            async with engine.stream(reqs, max_in_flight=16) as results:
                return {r.request_id: r async for r in results}

    clean = await run([(f"g{i}", s) for i, s in enumerate(good)])
    items = [(f"g{i}", s) for i, s in enumerate(good)]
    items += [(f"b{i}", bad[i % len(bad)]) for i in range(bad_n)]
    random.Random(0).shuffle(items)
    t = time.perf_counter()
    rss0 = rss_mib()
    mixed = await run(items)
    seconds = time.perf_counter() - t
    equal = sum(
        1
        for rid, expected in clean.items()
        if mixed[rid].error is None
        and mixed[rid].prompt_token_ids == expected.prompt_token_ids
        and all(torch.equal(mixed[rid].mm_kwargs[k], v) for k, v in expected.mm_kwargs.items())
    )
    typed = sum(isinstance(mixed[f"b{i}"].error, AiommError) for i in range(bad_n))
    kinds: dict[str, int] = {}
    for i in range(bad_n):
        name = type(mixed[f"b{i}"].error).__name__
        kinds[name] = kinds.get(name, 0) + 1
    print(f"hostile mix: {len(items)} requests ({bad_n} hostile, {len(bad)} kinds) in "
          f"{seconds:.1f} s; RSS {rss0:.0f} -> {rss_mib():.0f} MiB")  # fmt: skip
    print(f"  good requests equal to a clean run: {equal}/{len(clean)}")
    print(f"  hostile requests with a typed error: {typed}/{bad_n}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))  # fmt: skip


# -- 2. overload ---------------------------------------------------------------------------------


async def capacity(processor, images: list[bytes], n: int) -> float:  # type: ignore[no-untyped-def]
    config = EngineConfig(device="cpu", cache_capacity_bytes=0)
    async with Engine(processor, config) as engine:
        reqs = [Request(prompt=PH, images=[images[i % len(images)]]) for i in range(n)]
        t = time.perf_counter()
        async with engine.stream(reqs, max_in_flight=16) as results:
            async for _ in results:
                pass
        return n / (time.perf_counter() - t)


async def open_loop(  # type: ignore[no-untyped-def]
    processor, server: HostileServer, images: list[bytes], rate: float, seconds: float
) -> dict[str, float]:
    config = EngineConfig(
        device="cpu",
        cache_capacity_bytes=0,
        max_in_flight=16,
        max_waiting=32,
        fetch=fetch_config(total_timeout=2.0),
    )
    rng = random.Random(2)
    inline_latency: list[float] = []
    counts = {"ok": 0, "shed": 0, "other": 0, "offered": 0}
    peak_rss = rss_mib()
    async with Engine(processor, config) as engine:

        async def one(i: int, slow: bool) -> None:
            nonlocal peak_rss
            t = time.perf_counter()
            source = server.url("/drip") if slow else images[i % len(images)]
            result = await engine.process_safe(Request(prompt=PH, images=[source]))
            if result.error is None:
                counts["ok"] += 1
                if not slow:
                    inline_latency.append(time.perf_counter() - t)
            elif isinstance(result.error, OverloadedError):
                counts["shed"] += 1
            else:
                counts["other"] += 1
            peak_rss = max(peak_rss, rss_mib())

        start = time.perf_counter()
        rss0 = rss_mib()
        async with anyio.create_task_group() as tg:
            i = 0
            next_at = start
            while next_at - start < seconds:
                await anyio.sleep(max(0.0, next_at - time.perf_counter()))
                tg.start_soon(one, i, rng.random() < 0.2)
                counts["offered"] += 1
                i += 1
                next_at += rng.expovariate(rate)
        served_s = time.perf_counter() - start
    lat = sorted(inline_latency) or [float("nan")]
    return {
        **counts,
        "served_rps": counts["ok"] / served_s,
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "rss_growth": peak_rss - rss0,
    }


async def overload(processor, server: HostileServer, seconds: float) -> None:  # type: ignore[no-untyped-def]
    images = [jpeg(200 + i) for i in range(64)]
    cap = await capacity(processor, images, 60 if seconds < 1 else 300)
    print(f"overload: capacity {cap:.0f} req/s closed loop (inline 96x128 JPEG, cache off); "
          "max_in_flight 16, max_waiting 32; 1 in 5 arrivals a slow-loris URL")  # fmt: skip
    for factor in (2, 5):
        r = await open_loop(processor, server, images, factor * cap, seconds)
        print(f"  {factor}x ({factor * cap:.0f} req/s offered, {r['offered']:.0f} requests): "
              f"served {r['served_rps']:.0f} req/s, ok {r['ok']:.0f}, shed {r['shed']:.0f} "
              f"(OverloadedError), other errors {r['other']:.0f}; inline latency p50 "
              f"{r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms; "
              f"peak RSS +{r['rss_growth']:.0f} MiB")  # fmt: skip


# -- 3. cancellation storm -----------------------------------------------------------------------


async def cancellation_storm(processor, server: HostileServer, n: int) -> None:  # type: ignore[no-untyped-def]
    images: list[object] = [jpeg(300 + i) for i in range(50)]
    images += [server.url("/drip"), server.url("/endless"), server.url("/good.png")]
    rng = random.Random(3)
    config = EngineConfig(device="cpu", fetch=fetch_config())
    gc.collect()
    rss0 = rss_mib()
    async with Engine(processor, config) as engine:

        async def one(i: int) -> None:
            with anyio.move_on_after(rng.uniform(0, 0.5)):
                await engine.process_safe(Request(prompt=PH, images=[images[i % len(images)]]))

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        with anyio.fail_after(30):
            while True:  # detached single-flight work finishes in the engine's task group
                s = engine.stats()
                if s.decoded_bytes.in_use == 0 and all(
                    q.in_use == 0 and q.waiting == 0 for q in s.queues.values()
                ):
                    break
                await anyio.sleep(0.05)
        balanced = s.requests_started == (
            s.requests_completed + s.requests_failed + s.requests_cancelled
        )
    gc.collect()
    print(f"cancellation storm: {n} requests, cancelled at random within 0.5 s: "
          f"{s.requests_cancelled} cancelled, {s.requests_completed} completed, "
          f"{s.requests_failed} failed, {s.requests_shed} shed; idle afterwards, "
          f"counters balanced: {balanced}; "
          f"RSS {rss0:.0f} -> {rss_mib():.0f} MiB after close")  # fmt: skip


# -- 4. soak -------------------------------------------------------------------------------------


async def soak(processor, n: int) -> None:  # type: ignore[no-untyped-def]
    images = [jpeg(1000 + i, 96 + (i % 7) * 8, 128) for i in range(400)]
    config = EngineConfig(device="cpu", cache_capacity_bytes=4 << 20)  # evictions all along
    marks: list[tuple[int, float]] = []
    errors = 0
    async with Engine(processor, config) as engine:
        reqs = (Request(prompt=PH, images=[images[i % len(images)]]) for i in range(n))
        t = time.perf_counter()
        async with engine.stream(reqs, max_in_flight=32) as results:
            done = 0
            async for r in results:
                errors += r.error is not None
                done += 1
                if done in (1, n // 2, n):
                    marks.append((done, rss_mib()))
        seconds = time.perf_counter() - t
        evictions = engine.stats().cache.evictions
    (_, start), (_, middle), (_, end) = marks
    print(f"soak: {n} requests in {seconds:.0f} s ({n / seconds:.0f} req/s), {errors} errors, "
          f"{evictions} cache evictions; RSS start {start:.0f} MiB, middle {middle:.0f} MiB, "
          f"end {end:.0f} MiB (second half {end - middle:+.0f} MiB)")  # fmt: skip


# -- 5. restarts ---------------------------------------------------------------------------------


async def restarts(processor, engines: int) -> None:  # type: ignore[no-untyped-def]
    images = [jpeg(2000 + i) for i in range(20)]
    readings = []
    gc.collect()
    before = rss_mib()
    for k in range(engines):
        async with Engine(processor, EngineConfig(device="cpu")) as engine:
            for data in images:
                await engine.process(Request(prompt=PH, images=[data]))
        if (k + 1) % max(engines // 5, 1) == 0:
            gc.collect()
            readings.append(f"{rss_mib():.0f}")
    print(f"restarts: {engines} engines x {len(images)} requests; RSS before {before:.0f} MiB, "
          f"after each fifth: {', '.join(readings)} MiB")  # fmt: skip


# -- 6. fuzz -------------------------------------------------------------------------------------

_FUZZ = """
import sys, atheris
with atheris.instrument_imports():
    import PIL.Image, PIL.PngImagePlugin, PIL.JpegImagePlugin, PIL.GifImagePlugin
from aiomm.media.image import decode_image
from aiomm.errors import DecodeError, ImageTooLargeError

def one(data):
    try:
        decode_image(data, max_pixels=1 << 22, max_pixels_per_byte=8192)
    except (DecodeError, ImageTooLargeError):
        pass

atheris.Setup(sys.argv, one)
atheris.Fuzz()
"""


def fuzz(seconds: int) -> None:
    try:
        import atheris  # noqa: F401
    except ImportError:
        print("fuzz: atheris not installed (pip install 'aiomm[fuzz]'); skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        for i, data in enumerate([jpeg(1), GOOD_PNG, _one_bit_png(64, 64)]):
            (corpus / f"seed{i}").write_bytes(data)
        script = Path(tmp) / "fuzz_decode.py"
        script.write_text(_FUZZ)
        out = subprocess.run(
            [sys.executable, "-P", str(script), f"-max_total_time={seconds}", "-rss_limit_mb=4096",
             f"-artifact_prefix={tmp}/", str(corpus)],
            capture_output=True, text=True, timeout=seconds + 120,
        )  # fmt: skip
    log = out.stderr
    runs = next((ln for ln in log.splitlines() if ln.startswith("Done ")), "no summary")
    cov = [ln for ln in log.splitlines() if " cov: " in ln]
    crashed = out.returncode != 0
    verdict = "an untyped exception or crash (see artifacts)" if crashed else "no crash"
    print(f"fuzz: atheris on decode_image for {seconds} s: {runs}; "
          f"{cov[-1].split(' cov: ')[1].split()[0] if cov else '?'} edges covered; "
          f"{verdict}")  # fmt: skip
    if crashed:
        print(log[-3000:])


#: (hostile mix requests, overload seconds, storm requests, soak requests, engines, fuzz seconds)
SIZES = {
    "smoke": (30, 0.5, 50, 200, 2, 2),
    "quick": (90, 2.0, 200, 1000, 5, 5),
}


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    processor = build_processor("qwen2-vl")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    mix, seconds, storm, soak_n, engines, fuzz_s = SIZES.get(
        mode, (900, 10.0, 2000, args.soak, 50, args.fuzz_seconds)
    )
    print(f"reliability run: {mode}, {os.cpu_count()} cores, RSS {rss_mib():.0f} MiB at start")
    with HostileServer(ROUTES).running() as server:
        await hostile_mix(processor, server, mix)
        await overload(processor, server, seconds)
        await cancellation_storm(processor, server, storm)
    await soak(processor, soak_n)
    await restarts(processor, engines)
    fuzz(fuzz_s)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test's run)")
    parser.add_argument("--soak", type=int, default=12_000, help="soak requests (>= 10,000)")
    parser.add_argument("--fuzz-seconds", type=int, default=60)
    anyio.run(main, parser.parse_args())
