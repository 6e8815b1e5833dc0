"""``--sweep``: threads x max_in_flight (closed loop), then the queue bound (open loop at 2x)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .loadgen import arrival_times, closed_loop, measured, open_loop
from .processors import aiomm_processor
from .systems.aiomm import aiomm_server
from .workload import load_workload


def run_sweep(job: dict[str, Any]) -> dict[str, Any]:
    """The grid, the queue-bound runs, the best settings and why each was chosen."""
    wl = load_workload(Path(job["workload"]))
    processor = aiomm_processor()
    n = min(job["sweep_requests"], len(wl.requests))
    grid = []
    for t in job["sweep_threads"]:
        for m in job["sweep_in_flight"]:
            make = aiomm_server(wl, processor, threads=t, max_in_flight=m, queue_bound=m)
            rec = measured(make, lambda s: closed_loop(s, n, job["concurrency"]), job["loop"])
            total = rec.get("engine", {}).get("stages", {}).get("total", {})
            grid.append(
                {
                    "threads": t,
                    "max_in_flight": m,
                    "images_per_s": rec["images_per_s"],
                    "requests_per_s": rec["requests_per_s"],
                    "p99_ms": rec["latency_ms"]["p99"],
                    "engine_p99_ms": total.get("p99_ms", math.nan),
                    "rss_peak_mb": rec["rss_peak_mb"],
                }
            )
    best_rate = max(g["images_per_s"] for g in grid)
    best_t = max(grid, key=lambda g: g["images_per_s"])["threads"]
    row_t = [g for g in grid if g["threads"] == best_t]
    top_t = max(g["images_per_s"] for g in row_t)
    knee = min(
        (g for g in row_t if g["images_per_s"] >= 0.95 * top_t), key=lambda g: g["max_in_flight"]
    )
    after = [g for g in row_t if g["max_in_flight"] > knee["max_in_flight"]]
    m = knee["max_in_flight"]
    capacity = knee["requests_per_s"]
    queue_rows = []
    # the whole workload: an overload needs time to show its steady state
    n_open = min(job["requests"], len(wl.requests))
    arrivals = arrival_times(job["seed"], 2 * capacity, job["window_s"], n_open)
    for q in sorted({max(1, m // 2), m, 2 * m, 4 * m}):
        make = aiomm_server(wl, processor, threads=best_t, max_in_flight=m, queue_bound=q)
        rec = measured(make, lambda s: open_loop(s, n_open, arrivals, job["drain_s"]), job["loop"])
        queue_rows.append(
            {
                "queue_bound": q,
                "offered_rps": 2 * capacity,
                "served_rps": rec["requests_per_s"],
                "images_per_s": rec["images_per_s"],
                "rejected": rec["rejected"],
                "requests": rec["requests"],
                "p50_ms": rec["latency_ms"]["p50"],
                "p99_ms": rec["latency_ms"]["p99"],
                "rss_growth_mb": rec["rss_growth_mb"],
            }
        )
    top_q = max(r["served_rps"] for r in queue_rows)
    best_q = min(
        (r for r in queue_rows if r["served_rps"] >= 0.95 * top_q), key=lambda r: r["queue_bound"]
    )
    longer = [r for r in queue_rows if r["queue_bound"] > best_q["queue_bound"]]
    why = [
        f"threads={best_t}: the most images/s ({best_rate:.1f}).",
        f"max_in_flight={m}: the knee, the smallest value within 5% of the best throughput at "
        f"{best_t} threads ({knee['images_per_s']:.1f} vs {top_t:.1f} images/s); "
        + (
            f"beyond it throughput stays flat (<= {max(g['images_per_s'] for g in after):.1f}) "
            f"while the engine-side p99 grows to {max(g['engine_p99_ms'] for g in after):.0f} ms "
            f"(from {knee['engine_p99_ms']:.0f} ms): more in flight only queues inside the engine."
            if after
            else "it is the largest value tried."
        ),
        f"queue_bound={best_q['queue_bound']}: at 2x capacity the smallest queue that still "
        f"serves within 5% of the best ({best_q['served_rps']:.2f} vs {top_q:.2f} req/s, p99 "
        f"{best_q['p99_ms']:.0f} ms); "
        + (
            f"a longer one only adds waiting (p99 up to {max(r['p99_ms'] for r in longer):.0f} "
            "ms), a shorter one sheds requests the workers could have served."
            if longer
            else "it is the longest tried: shorter ones shed requests the workers could serve."
        ),
    ]
    return {
        "status": "ok",
        "grid": grid,
        "queue": queue_rows,
        "requests": n,
        "best": {"threads": best_t, "max_in_flight": m, "queue_bound": best_q["queue_bound"]},
        "why": why,
    }
