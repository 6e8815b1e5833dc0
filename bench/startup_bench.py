"""Time to first result: where a fresh process spends its start-up before the first request.

Each run starts a fresh interpreter that imports torch, then aiomm, builds the embedded default
(``Engine.from_pretrained("qwen2-vl")``, or ``--model``'s: the processor from its stored
snapshot, so neither transformers nor torchvision is imported), opens the engine and processes
one JPEG; every phase is stamped with ``time.perf_counter`` (CLOCK_MONOTONIC, shared by
processes), so "first result" runs from the parent's spawn, and the heavy modules loaded by then
are listed. A second process runs ``aiomm run --samples 1`` (the CLI's ``main``, the first result
stamped when the CLI writes it), a third the whole command as a subprocess. Medians over
``--runs`` interleaved runs; warm disk caches after the first run. ``--reference`` adds the
engine over the processor built on the real HF processor (transformers and torchvision imported:
the start-up without the snapshots).

    python bench/startup_bench.py [--runs 5] [--reference] [--model NAME] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PHASES = ("python", "torch", "aiomm", "processor", "open", "result")
#: modules whose import the first result should not wait for
HEAVY = ("transformers", "torchvision", "torch._dynamo", "triton", "tokenizers", "httpx")

_CHILD = r"""
import sys, time, json
stamps = {"python": time.perf_counter()}
import torch; stamps["torch"] = time.perf_counter()
import anyio, numpy as np
from aiomm import Engine, EngineConfig, Request
from aiomm.media.samples import encode, photo_like
stamps["aiomm"] = time.perf_counter()
if REFERENCE:
    from aiomm.adapters import build_processor, get_adapter_info
    hf = get_adapter_info(MODEL).build_hf_processor()
    config = EngineConfig(device="cpu")
    engine = Engine(build_processor(MODEL, hf, config=config.processing), config)
else:
    engine = Engine.from_pretrained(MODEL, EngineConfig(device="cpu"))
stamps["processor"] = time.perf_counter()
data = encode(photo_like(np.random.default_rng(0), 480, 640))
# one image placeholder as the architecture's chat template writes it
prompt = "describe " + engine.processor.dummy_inputs.get_dummy_text({"image": 1})

async def main():
    async with engine:
        stamps["open"] = time.perf_counter()
        result = await engine.process(Request(prompt=prompt, images=[data]))
        assert result.ok, result.error
        stamps["result"] = time.perf_counter()

anyio.run(main)
stamps["loaded"] = [m for m in HEAVY if m in sys.modules]
print(json.dumps(stamps))
"""

# ``aiomm run --samples 1`` in-process: the CLI writes each result's summary as it arrives
_CLI_CHILD = r"""
import json, sys, time
from aiomm import types
first = []
summary = types.Result.summary
def stamped(self):
    first.append(first[0] if first else time.perf_counter())
    return summary(self)
types.Result.summary = stamped
from aiomm.cli import main
rc = main(["run", "--samples", "1", "--no-progress"])
assert rc == 0, rc
print(json.dumps({"first_result": first[0], "loaded": [m for m in HEAVY if m in sys.modules]}))
"""

LABELS = {
    "python": "interpreter start",
    "torch": "import torch",
    "aiomm": "import aiomm",
    "processor": "build the processor",
    "open": "open the engine",
    "result": "first request",
    "first_result": "spawn -> first result",
}


def _env() -> dict[str, str]:
    # the repo root must not be on sys.path: its top-level kernels/ would shadow transformers'
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _child(code: str, **names: Any) -> tuple[float, dict[str, Any]]:
    """Run ``code`` in a fresh interpreter: its spawn time and its last line's JSON."""
    prelude = "".join(f"{k} = {v!r}\n" for k, v in {"HEAVY": HEAVY, **names}.items())
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-P", "-c", prelude + code],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
        cwd=Path.home(),
    )
    return t0, json.loads(out.stdout.strip().splitlines()[-1])


def phases_once(reference: bool = False, model: str = "qwen2-vl") -> dict[str, Any]:
    """One fresh process: seconds spent in each phase, and from spawn to the first result."""
    t0, stamps = _child(_CHILD, REFERENCE=reference, MODEL=model)
    record: dict[str, Any] = {}
    before = t0
    for name in PHASES:
        record[name] = stamps[name] - before
        before = stamps[name]
    record["first_result"] = stamps["result"] - t0
    record["loaded"] = stamps["loaded"]
    return record


def cli_first_result_once() -> dict[str, Any]:
    """Seconds from spawn to the first result ``aiomm run --samples 1`` writes."""
    t0, out = _child(_CLI_CHILD)
    return {"first_result": out["first_result"] - t0, "loaded": out["loaded"]}


def cli_once() -> float:
    """Wall seconds of the whole ``aiomm run --samples 1`` command."""
    exe = shutil.which("aiomm") or str(Path(sys.executable).with_name("aiomm"))
    t0 = time.perf_counter()
    subprocess.run(
        [exe, "run", "--samples", "1", "--no-progress"],
        capture_output=True,
        check=True,
        env=_env(),
        cwd=Path.home(),
    )
    return time.perf_counter() - t0


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in LABELS}


def run(runs: int, reference: bool = False, model: str = "qwen2-vl") -> dict[str, Any]:
    """Medians over ``runs`` interleaved runs of every timing (the CLI's on the embedded
    default, the engine's on ``model``)."""
    phase_runs: list[dict[str, Any]] = []
    ref_runs: list[dict[str, Any]] = []
    first_runs: list[dict[str, Any]] = []
    cli_runs: list[float] = []
    for _ in range(runs):
        phase_runs.append(phases_once(model=model))
        if reference:
            ref_runs.append(phases_once(reference=True, model=model))
        first_runs.append(cli_first_result_once())
        cli_runs.append(cli_once())
    record: dict[str, Any] = {
        "runs": runs,
        "model": model,
        "median_s": _medians(phase_runs),
        "loaded": phase_runs[-1]["loaded"],
        "aiomm_run_first_result_s": statistics.median(r["first_result"] for r in first_runs),
        "aiomm_run_loaded": first_runs[-1]["loaded"],
        "aiomm_run_samples_1_s": statistics.median(cli_runs),
        "load_average": os.getloadavg(),
        "all": {"phases": phase_runs, "cli_first": first_runs, "cli": cli_runs},
    }
    if reference:
        record["reference_median_s"] = _medians(ref_runs)
        record["reference_loaded"] = ref_runs[-1]["loaded"]
        record["all"]["reference"] = ref_runs
    return record


def report(record: dict[str, Any]) -> str:
    m, ref = record["median_s"], record.get("reference_median_s")
    lines = [
        f"start-up of {record['model']}, median of {record['runs']} fresh processes (s):",
        f"  {'':<38} {'stored':>7}" + (f" {'HF-built':>9}" if ref else ""),
    ]
    for key, label in LABELS.items():
        lines.append(f"  {label:<38} {m[key]:7.2f}" + (f" {ref[key]:9.2f}" if ref else ""))
    lines.append(f"  {'loaded by the first result':<38} {', '.join(record['loaded']) or '-'}")
    if ref:
        loaded = ", ".join(record["reference_loaded"]) or "-"
        lines.append(f"  {'loaded by the first result (HF-built)':<38} {loaded}")
    lines.append(f"  {'aiomm run --samples 1: first result':<38} "
                 f"{record['aiomm_run_first_result_s']:7.2f}")  # fmt: skip
    lines.append(f"  {'aiomm run --samples 1: whole command':<38} "
                 f"{record['aiomm_run_samples_1_s']:7.2f}")  # fmt: skip
    load = ", ".join(f"{v:.2f}" for v in record["load_average"])
    lines.append(f"  load average (1, 5, 15 min) at the end: {load}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--reference", action="store_true", help="also time the HF-built processor")
    p.add_argument("--json", type=Path)
    p.add_argument("--model", default="qwen2-vl", help="the architecture the engine builds")
    args = p.parse_args(argv)
    record = run(args.runs, reference=args.reference, model=args.model)
    print(report(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
