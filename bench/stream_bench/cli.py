"""The command line: ``aiomm bench``, or ``python bench/stream_bench`` without aiomm's command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiomm.logging import configure_logging

from .analysis import analyse
from .jobs import run_child, run_job
from .loadgen import json_safe
from .measure import cores
from .plot import PlotUnavailableError, plot
from .report import report
from .systems import SYSTEMS
from .systems.vllm import run_vllm, same_as_aiomm
from .workload import (
    FULL_SIZES,
    QUICK_SIZES,
    WorkloadSpec,
    describe_workload,
    ensure_workload,
    exact_sample,
    load_workload,
)

_DESCRIPTION = (
    "Streaming benchmark: aiomm against the baselines, side by side, with backpressure tuning."
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default, except where there is none to show (None, a flag's False) or
    where its help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiomm bench",
        description=_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny workload, every system, < 1 minute")
    p.add_argument(
        "--out", type=Path, default=Path("results/stream_bench"), help="folder of the results"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    w = p.add_argument_group("workload")
    w.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    w.add_argument(
        "--requests",
        type=int,
        help="requests (default: 12 quick, 240 full: an open loop needs seconds of arrivals)",
    )
    w.add_argument(
        "--repeat-share", type=float, default=0.25, help="share of images seen before (cache hits)"
    )
    w.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of image popularity")
    w.add_argument("--max-images", type=int, default=4, help="images per request at most")
    w.add_argument("--png-share", type=float, default=0.25, help="share of PNG images")
    lg = p.add_argument_group("load")
    lg.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    lg.add_argument(
        "--open-loads",
        help="open-loop rates as multiples of each system's "
        "capacity (default: 2 quick, 0.5,1,2 full)",
    )
    lg.add_argument(
        "--window", type=float, help="open-loop arrival window, s (default: 2 quick, 12 full)"
    )
    lg.add_argument(
        "--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the event loop"
    )
    a = p.add_argument_group("aiomm")
    a.add_argument("--threads", type=int, default=cores(), help="transform threads")
    a.add_argument("--max-in-flight", type=int, default=8, help="requests processed at once")
    a.add_argument("--queue-bound", type=int, default=16, help="requests waiting for admission")
    a.add_argument("--no-cache", action="store_true", help="turn aiomm's item cache off")
    a.add_argument("--scaling-threads", help="thread counts to scale over (default: 1..cores)")
    a.add_argument(
        "--scaling-repeats",
        type=int,
        help="interleaved runs per thread count, best kept (default: 1 quick, 3 full)",
    )
    v = p.add_argument_group("vllm")
    v.add_argument(
        "--vllm-python",
        help="python of a vLLM environment (vllm 0.33, CPU; default: vLLM skipped)",
    )
    v.add_argument(
        "--vllm-cache",
        choices=["lru", "processor_only", "none"],
        default="lru",
        help="vLLM's processor cache (lru: its default for one API process)",
    )
    v.add_argument(
        "--vllm-media-threads",
        type=int,
        default=8,
        help="vLLM's media loading pool (VLLM_MEDIA_LOADING_THREAD_COUNT)",
    )
    p.add_argument("--sweep", action="store_true", help="tune threads x max_in_flight x queue")
    p.add_argument("--gpu", action="store_true", help="add the CUDA device stage (aiomm-gpu)")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one process per system (default: on, off with --quick)",
    )
    p.add_argument("--exact-samples", type=int, help="requests checked (default: 2 quick, 6 full)")
    z = p.add_argument_group("size classes (instead of the streaming run)")
    z.add_argument(
        "--sizes",
        help="longest edges, e.g. 512,1024,2048: aiomm (float32, uint8), hf-threads and the floor "
        "per size class, and the fast mode against exact",
    )
    z.add_argument(
        "--per-class",
        type=int,
        help="images per size class (default: about 64 MP of pixels, 24 to 400: 256 at 512)",
    )
    z.add_argument(
        "--size-repeats",
        type=int,
        default=3,
        help="interleaved rounds (the best run of each system is kept, and each round's"
        " aiomm uint8 / floor run ratio)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _run_sizes(args: argparse.Namespace) -> int:
    from .sizes import report_sizes, run_sizes

    record = run_sizes(
        _ints(args.sizes),
        per_class=args.per_class,
        threads=args.threads,
        concurrency=args.max_in_flight,
        repeats=args.size_repeats,
        seed=args.seed,
        vllm_python=args.vllm_python,
        out=args.out,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sizes.json"
    path.write_text(json.dumps(json_safe(record), indent=1))
    print(report_sizes(record))
    print(f"results: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when it ran and aiomm's outputs are exact."""
    args = _parser().parse_args(argv)
    if args.child:
        return run_child(args.child)
    configure_logging(level="WARNING")
    if args.sizes:
        return _run_sizes(args)
    quick = args.quick
    isolate = (not quick) if args.isolate is None else args.isolate
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    n = args.requests or (12 if quick else 240)
    spec = WorkloadSpec(
        seed=args.seed,
        requests=n,
        repeat_share=args.repeat_share,
        zipf_s=args.zipf,
        max_images=args.max_images,
        png_share=args.png_share,
        sizes=QUICK_SIZES if quick else FULL_SIZES,
    )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"stream_bench: workload under {out / 'workload'} ...", file=sys.stderr)
    folder = ensure_workload(spec, out / "workload")
    wl = load_workload(folder)
    cpu = cores()
    open_factors = [float(x) for x in (args.open_loads or ("2" if quick else "0.5,1,2")).split(",")]
    window = args.window or (2.0 if quick else 12.0)
    if args.scaling_threads:
        scaling_threads = _ints(args.scaling_threads)
    else:
        scaling_threads = list(range(1, cpu + 1)) if cpu > 1 else [1, 2]
    base = {
        "workload": str(folder),
        "requests": n,
        "concurrency": args.concurrency,
        "open_factors": open_factors,
        "window_s": window,
        "drain_s": max(2.0, window),
        "seed": args.seed,
        "loop": args.loop,
        "threads": args.threads,
        "max_in_flight": args.max_in_flight,
        "queue_bound": args.queue_bound,
        "cache": not args.no_cache,
        "scaling_threads": scaling_threads,
        "scaling_requests": 6 if quick else 40,
        "scaling_repeats": args.scaling_repeats or (1 if quick else 3),
        "exact_requests": exact_sample(wl, n, args.exact_samples or (2 if quick else 6)),
    }
    results: dict[str, Any] = {
        "meta": {
            "mode": "quick" if quick else "full",
            "cores": cpu,
            "python": sys.version.split()[0],
            "concurrency": args.concurrency,
            "isolated": isolate,
            "args": vars(args),
            "workload": describe_workload(wl, n),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "systems": {},
    }
    del wl
    results["checks"] = run_job({**base, "kind": "checks"}, out, isolate, "checks")
    for name in systems:
        if name == "vllm":
            job = {**base, "vllm_cache": args.vllm_cache, "media_threads": args.vllm_media_threads}
            rec = run_vllm(job, args.vllm_python, out)
            same = same_as_aiomm(rec, results["checks"].get("exact", {}).get("rows", []))
            if same is not None:
                rec["exact_vs_aiomm"] = same
        else:
            rec = run_job({**base, "kind": "system", "system": name}, out, isolate, name)
        results["systems"][name] = rec
    if args.gpu:
        gpu = run_job({**base, "kind": "gpu"}, out, isolate, "aiomm-gpu")
        results["gpu"] = gpu
        if gpu.get("status") == "ok":
            results["systems"]["aiomm-gpu"] = gpu
    if args.sweep:
        results["sweep"] = run_job(
            {
                **base,
                "kind": "sweep",
                "sweep_requests": 6 if quick else 40,
                "sweep_threads": [1, 2] if quick else sorted({1, cpu, 2 * cpu}),
                "sweep_in_flight": [2, 8] if quick else [1, 2, 4, 8, 16, 32],
            },
            out,
            isolate,
            "sweep",
        )
    results["analysis"] = analyse(results)
    (out / "stream_bench.json").write_text(json.dumps(json_safe(results), indent=1))
    written = [out / "stream_bench.json"]
    try:
        plot(results, out / "stream_bench.png")
        written.append(out / "stream_bench.png")
    except PlotUnavailableError as exc:
        print(f"stream_bench.png not written: {exc}", file=sys.stderr)
    print(report(results))
    print(f"results: {', '.join(str(p) for p in written)}")
    failed = [n for n, r in results["systems"].items() if r.get("status") == "failed"]
    for name in failed:
        print(
            f"{name} failed: {results['systems'][name].get('reason')}\n"
            f"{results['systems'][name].get('traceback', '')}",
            file=sys.stderr,
        )
    exact = results["checks"].get("exact", {}).get("exact")
    return 0 if exact and not failed else 1
