"""The table printed at the end of a run: systems side by side, open loop, scaling, targets."""

from __future__ import annotations

import math
from typing import Any

from .analysis import computed_per_s
from .exactness import NORM_RTOL


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def report(results: dict[str, Any]) -> str:
    """The benchmark's results as the text table printed on stdout."""
    meta, lines = results["meta"], []
    w = meta["workload"]
    lines.append(
        f"aiomm stream_bench ({meta['mode']}): {w['requests']} requests, {w['images']} "
        f"images ({w['unique_images']} unique, {w['repeat_share']:.0%} repeats, "
        f"{w['png_unique']} PNG), {w['megapixels_mean']:.1f} MP mean; closed loop "
        f"c={meta['concurrency']}; {meta['cores']} cores"
    )
    exact = results.get("checks", {}).get("exact", {})
    head = (
        f"{'system':<14}{'img/s':>8}{'req/s':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
        f"{'cpu':>6}{'cpu ms/img':>11}{'RSS MB':>8}{'hits':>6}{'joins':>6}{'aiomm/x':>8}"
        "  exact"
    )
    lines += [head, "-" * len(head)]
    ratios = results["analysis"]["ratios"]
    for name, rec in results["systems"].items():
        if rec.get("status") != "ok":
            lines.append(f"{name:<14}{rec.get('status')}: {rec.get('reason')}")
            continue
        c = rec["closed"]
        if name == "aiomm":
            ex = "yes" if exact.get("exact") else "no"
        elif name == "vllm":
            ex = {True: "yes", False: "no"}.get(rec.get("exact_vs_aiomm"), "-")
        else:
            ex = "ref"
        lat = c["latency_ms"]
        lines.append(
            f"{name:<14}{_fmt(c['images_per_s']):>8}{_fmt(c['requests_per_s'], '.2f'):>8}"
            f"{_fmt(lat['p50'], '.0f'):>9}{_fmt(lat['p90'], '.0f'):>9}{_fmt(lat['p99'], '.0f'):>9}"
            f"{_fmt(c['cpu_util'] * 100, '.0f') + '%':>6}"
            f"{_fmt(results['analysis']['cpu_ms_per_image'].get(name)):>11}"
            f"{_fmt(c['rss_peak_mb'], '.0f'):>8}"
            f"{c['cache_hits']:>6}{c['cache_joins']:>6}"
            f"{_fmt(ratios.get(f'aiomm/{name}'), '.2f'):>8}  {ex}"
        )
    floor = results.get("checks", {}).get("floor")
    if floor:
        lines.append(
            f"floor: decode {floor['decode_s']:.2f} s + resize {floor['resize_s']:.2f} s CPU, one "
            f"thread, for {floor['unique_images']} unique images / {floor['cores']} cores = "
            f"{floor['images_per_s']:.1f} images/s; aiomm reaches "
            f"{_fmt(results['analysis']['floor_fraction'], '.2f')} of it (CPU per image: floor "
            f"{floor['cpu_ms_per_image']:.1f} ms = "
            f"{_fmt(results['analysis']['floor_cpu_efficiency'], '.2f')} of aiomm's)"
        )
    if exact:
        lines.append(
            f"exact: {'yes' if exact.get('exact') else 'no'} ({exact['requests']} "
            f"requests, {exact['images']} images: uint8 pixels, grids and token ids "
            f"equal to HF; normalised max rel err {_fmt(exact['max_norm_rel_err'], '.1e')}"
            f" <= {NORM_RTOL:.0e})"
        )
    opens = [
        (n, r)
        for n, rec in results["systems"].items()
        if rec.get("status") == "ok"
        for r in rec.get("open", [])
    ]
    if opens:
        lines.append(
            "open loop (Poisson arrivals at a multiple of each system's closed-loop capacity; "
            "latency from the scheduled arrival; RSS growth while requests arrive, and the "
            "item cache's share of it; work/s: images computed, not served from the cache):"
        )
        lines.append(
            f"  {'system':<14}{'load':>6}{'arrive/s':>9}{'served/s':>9}{'img/s':>8}"
            f"{'work/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'shed':>6}{'unfin':>6}{'RSS +MB':>8}"
            f"{'cache':>7}"
        )
        for name, r in opens:
            arrived = r["requests"] / r["window_s"] if r["window_s"] else math.nan
            lines.append(
                f"  {name:<14}{r['factor']:>5.1f}x{arrived:>9.2f}"
                f"{r['requests_per_s']:>9.2f}{r['images_per_s']:>8.1f}{computed_per_s(r):>8.1f}"
                f"{_fmt(r['latency_ms']['p50'], '.0f'):>9}{_fmt(r['latency_ms']['p99'], '.0f'):>9}"
                f"{r['rejected']:>6}{r['unfinished']:>6}{r['rss_growth_mb']:>+8.0f}"
                f"{_fmt(r.get('cache_growth_mb'), '+.0f'):>7}"
            )
    scaling = results["systems"].get("aiomm", {}).get("scaling", [])
    if scaling:
        lines.append(
            "thread scaling (aiomm image path, cache off; threads on as many cores; best of "
            "interleaved runs): "
            + ", ".join(
                f"{r['threads']} -> {r['images_per_s']:.1f} img/s"
                + (
                    f" (runs {'/'.join(f'{x:.1f}' for x in r['runs_images_per_s'])})"
                    if len(r.get("runs_images_per_s", [])) > 1
                    else ""
                )
                for r in scaling
            )
            + f"; 2 vs 1: {_fmt(results['analysis']['thread_speedup_2v1'], '.2f')}x"
        )
    sweep = results.get("sweep")
    if sweep and sweep.get("status") == "ok":
        lines.append("sweep (closed loop; images/s by threads x max_in_flight):")
        ms = sorted({g["max_in_flight"] for g in sweep["grid"]})
        lines.append("  threads" + "".join(f"{m:>8}" for m in ms))
        for t in sorted({g["threads"] for g in sweep["grid"]}):
            row = {
                g["max_in_flight"]: g["images_per_s"] for g in sweep["grid"] if g["threads"] == t
            }
            lines.append(f"  {t:>7}" + "".join(f"{_fmt(row.get(m)):>8}" for m in ms))
        lines.append(
            "  queue bound at 2x capacity: "
            + ", ".join(
                f"{q['queue_bound']} -> {q['served_rps']:.2f} req/s p99 {q['p99_ms']:.0f} ms "
                f"({q['rejected']}/{q['requests']} shed)"
                for q in sweep["queue"]
            )
        )
        b = sweep["best"]
        lines.append(
            f"  best: threads={b['threads']} max_in_flight={b['max_in_flight']} "
            f"queue_bound={b['queue_bound']}"
        )
        lines += [f"    {why}" for why in sweep["why"]]
    elif sweep:
        lines.append(f"sweep: {sweep.get('status')}: {sweep.get('reason')}")
    gpu = results.get("gpu")
    if gpu and gpu.get("status") == "ok":
        tr, pr = gpu["transfer"], gpu["probe"]
        lines.append(
            f"gpu: {tr['uint8_bytes'] / 2**20:.0f} MiB moved as uint8 vs "
            f"{tr['bf16_bytes'] / 2**20:.0f} MiB as bf16 (saved "
            f"{tr['saved_vs_bf16_bytes'] / 2**20:.0f} MiB, 50%); per 1080p image: H2D "
            f"pageable u8 {pr['h2d_pageable_uint8_s'] * 1e3:.2f} ms, pinned u8 "
            f"{pr['h2d_pinned_uint8_s'] * 1e3:.2f} ms, pinned bf16 "
            f"{pr['h2d_pinned_bf16_s'] * 1e3:.2f} ms, fused norm "
            f"{pr['fused_norm_s'] * 1e3:.2f} ms"
        )
    elif gpu:
        lines.append(f"gpu: {gpu.get('status')}: {gpu.get('reason')}")
    if results.get("meta", {}).get("mode") == "quick":
        # the project's own targets are judged on the full run (they stay in the JSON)
        return "\n".join(lines)
    lines.append("targets:")
    for t in results["analysis"]["targets"]:
        mark = {True: "PASS", False: "MISS", None: "n/a "}[t["pass"]]
        value = t["value"]
        shown = (
            ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in value.items())
            if isinstance(value, dict)
            else _fmt(value, ".3g")
        )
        lines.append(f"  [{mark}] {t['target']}: {shown}")
    return "\n".join(lines)
