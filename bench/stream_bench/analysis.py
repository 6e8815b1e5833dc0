"""Ratios aiomm / baseline, the floor fraction, thread scaling, the open loop at 2x; targets."""

from __future__ import annotations

import math
from typing import Any

from .measure import cores
from .systems import BASELINES

#: aiomm's images/s over each baseline's (closed loop)
TARGETS = {"hf-sequential": 3.0, "hf-threads": 1.5, "vllm": 1.5}
FLOOR_TARGET, SCALING_TARGET = 0.8, 1.7


def computed_per_s(rec: dict[str, Any]) -> float:
    """Images computed (neither a cache hit nor joined to one in flight) per second."""
    computed = rec["images"] - rec.get("cache_hits", 0) - rec.get("cache_joins", 0)
    return computed / rec["wall_s"] if rec["wall_s"] else math.nan


def analyse(results: dict[str, Any]) -> dict[str, Any]:
    """The analysis record of ``results``: ratios, fractions, speed-up and every target."""
    systems = results["systems"]
    aiomm = systems.get("aiomm", {})
    ok = aiomm.get("status") == "ok"
    ips = aiomm["closed"]["images_per_s"] if ok else math.nan
    ratios: dict[str, float | None] = {}
    targets = []
    for base in BASELINES:
        rec = systems.get(base, {})
        if ok and rec.get("status") == "ok" and rec["closed"]["images_per_s"] > 0:
            ratios[f"aiomm/{base}"] = ips / rec["closed"]["images_per_s"]
        else:
            ratios[f"aiomm/{base}"] = None
        value = ratios[f"aiomm/{base}"]
        targets.append(
            {
                "target": f"aiomm >= {TARGETS[base]}x {base} (images/s, closed loop)",
                "value": value,
                "pass": None if value is None else value >= TARGETS[base],
            }
        )
    checks = results.get("checks", {})
    exact = checks.get("exact", {}).get("exact")
    targets.append(
        {
            "target": "outputs equal to the reference processor (exact mode)",
            "value": checks.get("exact", {}).get("max_norm_rel_err"),
            "pass": exact,
        }
    )
    floor = checks.get("floor", {}).get("images_per_s", math.nan)
    fraction = ips / floor if ok and floor and floor == floor else None
    floor_cpu = checks.get("floor", {}).get("cpu_ms_per_image")
    cpu_ms = {
        name: rec["closed"]["cpu_s"] / rec["closed"]["images"] * 1000
        for name, rec in systems.items()
        if rec.get("status") == "ok" and rec["closed"]["images"]
    }
    targets.append(
        {
            "target": f"aiomm >= {FLOOR_TARGET} of the decode+resize floor",
            "value": fraction,
            "pass": None if fraction is None else fraction >= FLOOR_TARGET,
        }
    )
    scaling = {r["threads"]: r["images_per_s"] for r in aiomm.get("scaling", [])}
    speedup = scaling[2] / scaling[1] if 1 in scaling and 2 in scaling and scaling[1] else None
    targets.append(
        {
            "target": f"engine image path: 2 threads >= {SCALING_TARGET}x 1 thread",
            "value": speedup,
            "pass": None if speedup is None or cores() < 2 else speedup >= SCALING_TARGET,
        }
    )
    over = [r for r in aiomm.get("open", []) if r["factor"] >= 2] if ok else []
    if over:
        r = over[-1]
        capacity = aiomm["closed"]["requests_per_s"]
        # the item cache fills while new images arrive (bounded by cache_capacity_bytes);
        # the queues must not grow: judge the RSS growth net of the cache's
        net = r["rss_growth_mb"] - r.get("cache_growth_mb", 0.0)
        flat = net <= max(64.0, 0.1 * r["rss_start_mb"])
        # Capacity is judged in work: images computed (not cache hits) per second. Shedding
        # drops whole requests, and the served ones repeat fewer images (a repeat needs its
        # first occurrence served), so requests/s alone would count the cache as lost capacity.
        work = computed_per_s(r) / computed_per_s(aiomm["closed"])
        serving = work >= 0.8
        targets.append(
            {
                "target": "open loop at 2x capacity: RSS flat and serving at capacity",
                "value": {
                    "rss_growth_mb": r["rss_growth_mb"],
                    "of_it_cache_mb": r.get("cache_growth_mb", 0.0),
                    "served/capacity": r["requests_per_s"] / capacity,
                    "work/capacity": work,
                    "p99_ms": r["latency_ms"]["p99"],
                    "rejected": r["rejected"],
                },
                "pass": flat and serving,
            }
        )
    return {
        "ratios": ratios,
        "floor_fraction": fraction,
        "thread_speedup_2v1": speedup,
        "cpu_ms_per_image": cpu_ms,
        "floor_cpu_efficiency": floor_cpu / cpu_ms["aiomm"]
        if floor_cpu and "aiomm" in cpu_ms
        else None,
        "targets": targets,
    }
