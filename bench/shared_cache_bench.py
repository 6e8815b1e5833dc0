"""Two replicas sharing one Redis item cache vs two independent replicas, same Zipf workload.

Each replica is its own process running an :class:`aiomm.Engine` (CPU device, Qwen2-VL adapter
built offline; a fresh engine, so an empty first tier, per run, after one warm-up request). Both
replicas of a run start together (a barrier) and each streams its own
requests, drawn from one pool of distinct images with Zipf-distributed popularity, as a load
balancer spreads a gateway's traffic. The same request lists are replayed in both set-ups:

- ``independent``: each replica has only its in-process cache;
- ``shared``: both also use one redis-server on a loopback port (``shared_cache_url``).

Printed side by side: CPU per image (the replicas' process CPU, all threads, plus the
redis-server's CPU in the shared set-up), items computed, and the hit rate (any tier), then the
ratios shared / independent. Rounds alternate the two set-ups to spread the noise of a busy host.

    python bench/shared_cache_bench.py [--requests 300] [--pool 120] [--zipf 1.1] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from _support import SUPPORT

__all__ = ("main", "zipf_requests")


def zipf_requests(n: int, pool: int, s: float, seed: int) -> list[int]:
    """``n`` image indices in ``range(pool)``, rank ``r`` drawn with weight ``1 / (r + 1) ** s``."""
    weights = 1.0 / np.arange(1, pool + 1) ** s
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(pool, size=n, p=weights / weights.sum())]


def _image_bytes(index: int, height: int, width: int) -> bytes:
    from aiomm.media.samples import encode, photo_like

    return encode(photo_like(np.random.default_rng(1000 + index), height, width), "JPEG")


def _replica(size: tuple[int, int], barrier: Any, inbox: Any, out: Any) -> None:
    """One replica process: builds the processor once, then per task ``(url, indices)`` opens a
    fresh engine (empty first tier), waits for the other replica, streams, reports."""
    import anyio

    from aiomm import Engine, EngineConfig, Request
    from aiomm.adapters import build_processor

    processor = build_processor("qwen2-vl")
    placeholder = processor.dummy_inputs.get_dummy_text({"image": 1})
    images: dict[int, bytes] = {}
    warm = _image_bytes(-1, *size)

    async def run(url: str | None, indices: list[int]) -> dict[str, Any]:
        config = EngineConfig(
            device="cpu", transform_threads=2, torch_threads=1, shared_cache_url=url
        )
        requests = [Request(prompt=f"describe {placeholder}", images=[images[i]]) for i in indices]
        async with Engine(processor, config, adapter_id="qwen2-vl") as engine:
            await engine.process(Request(prompt=f"describe {placeholder}", images=[warm]))
            await anyio.to_thread.run_sync(barrier.wait)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            outcomes: Counter[str] = Counter()
            failed = 0
            async with engine.stream(requests, max_in_flight=8) as results:
                async for r in results:
                    failed += not r.ok
                    outcomes.update(c.value for c in r.cache)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            shared = engine.stats().cache.shared
        return {
            "cpu_s": cpu,
            "wall_s": wall,
            "images": len(requests),
            "failed": failed,
            "outcomes": dict(outcomes),
            "shared": None if shared is None else shared.__dict__,
        }

    while (task := inbox.get()) is not None:
        url, indices = task
        for i in indices:
            if i not in images:
                images[i] = _image_bytes(i, *size)
        out.put(anyio.run(run, url, indices))


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Replicas:
    """Two replica processes kept across rounds (spawned once: building a processor is slow)."""

    def __init__(self, size: tuple[int, int]) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(2)
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue(), ctx.Queue()]
        self.procs = [
            ctx.Process(target=_replica, args=(size, self.barrier, q, self.out), daemon=True)
            for q in self.inboxes
        ]
        for p in self.procs:
            p.start()

    def run(
        self, url: str | None, streams: list[list[int]], redis_pid: int | None
    ) -> dict[str, Any]:
        redis0 = _proc_cpu_s(redis_pid) if redis_pid else 0.0
        for inbox, stream in zip(self.inboxes, streams, strict=True):
            inbox.put((url, stream))
        reports = [self.out.get(timeout=1800) for _ in self.procs]
        redis_cpu = (_proc_cpu_s(redis_pid) - redis0) if redis_pid else 0.0
        outcomes: Counter[str] = Counter()
        for r in reports:
            outcomes.update(r["outcomes"])
        images = sum(r["images"] for r in reports)
        computed = outcomes["miss"] + outcomes["uncached"]
        return {
            "cpu_s": sum(r["cpu_s"] for r in reports) + redis_cpu,
            "redis_cpu_s": redis_cpu,
            "wall_s": max(r["wall_s"] for r in reports),
            "images": images,
            "failed": sum(r["failed"] for r in reports),
            "computed": computed,
            "hit_rate": 1 - computed / images,
            "outcomes": dict(outcomes),
        }

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=60)


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("cpu_s", "redis_cpu_s", "wall_s", "images", "failed", "computed")
    total = {k: sum(r[k] for r in runs) for k in keys}
    total["hit_rate"] = 1 - total["computed"] / total["images"]
    total["cpu_ms_per_image"] = 1000 * total["cpu_s"] / total["images"]
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per replica")
    parser.add_argument("--pool", type=int, default=120, help="distinct images")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent s")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per set-up")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(SUPPORT))
    from redis_server import RedisServer

    size = (args.height, args.width)
    runs: dict[str, list[dict[str, Any]]] = {"independent": [], "shared": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        replicas = _Replicas(size)
        try:
            for rnd in range(args.rounds):
                # fresh request streams each round: both set-ups replay the same ones
                streams = [
                    zipf_requests(args.requests, args.pool, args.zipf, seed=100 * rnd + k)
                    for k in range(2)
                ]
                order = ("independent", "shared") if rnd % 2 == 0 else ("shared", "independent")
                for setup in order:
                    if setup == "shared":
                        server.command("FLUSHALL")
                        assert server.proc is not None
                        result = replicas.run(server.url, streams, server.proc.pid)
                    else:
                        result = replicas.run(None, streams, None)
                    runs[setup].append(result)
                    print(f"round {rnd} {setup:<11} {json.dumps(result)}", flush=True)
        finally:
            replicas.close()
            server.stop()

    ind, sh = _merge(runs["independent"]), _merge(runs["shared"])
    print()
    print(
        f"two replicas, {args.requests} requests each x {args.rounds} rounds, {args.pool} "
        f"distinct {args.width}x{args.height} JPEGs, Zipf s={args.zipf}"
    )
    print(f"{'':<24}{'independent':>14}{'shared Redis':>14}{'shared/indep':>14}")
    rows = [
        ("CPU per image (ms)", ind["cpu_ms_per_image"], sh["cpu_ms_per_image"], ".2f"),
        ("items computed", ind["computed"], sh["computed"], "d"),
        ("hit rate (any tier)", ind["hit_rate"], sh["hit_rate"], ".3f"),
        ("wall time (s)", ind["wall_s"], sh["wall_s"], ".2f"),
    ]
    for name, a, b, fmt in rows:
        ratio = b / a if a else float("nan")
        print(f"{name:<24}{a:>14{fmt}}{b:>14{fmt}}{ratio:>14.3f}")
    print(f"redis-server CPU (s, included above): {sh['redis_cpu_s']:.2f}")
    miss_ratio = (1 - sh["hit_rate"]) / (1 - ind["hit_rate"]) if ind["hit_rate"] < 1 else 0
    print(f"miss rate shared/independent: {miss_ratio:.3f}")
    if ind["failed"] or sh["failed"]:
        print(f"FAILED requests: independent {ind['failed']}, shared {sh['failed']}")
        return 1
    if args.json:
        args.json.write_text(json.dumps({"independent": ind, "shared": sh, "args": vars(args)},
                                        default=str, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
