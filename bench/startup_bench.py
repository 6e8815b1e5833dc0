"""Time to first result: where a fresh process spends its start-up before the first request.

Each run starts a fresh interpreter that imports torch, transformers and torchvision (which every
transformers image processor imports, and which imports ``torch._dynamo``), then aiomm, builds the
embedded default (``Engine.from_pretrained("qwen2-vl")``), opens the engine and processes one
JPEG; every phase is stamped with ``time.perf_counter`` (CLOCK_MONOTONIC, shared by processes), so
"first result" runs from the parent's spawn. A second timing runs the whole ``aiomm run
--samples 1`` command. Medians over ``--runs``; warm disk caches after the first run.

    python bench/startup_bench.py [--runs 5] [--json out.json]
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

PHASES = ("python", "torch", "transformers", "torchvision", "aiomm", "processor", "open", "result")

_CHILD = r"""
import time, json
stamps = {"python": time.perf_counter()}
import torch; stamps["torch"] = time.perf_counter()
import transformers; stamps["transformers"] = time.perf_counter()
import torchvision; stamps["torchvision"] = time.perf_counter()
import anyio, numpy as np
from aiomm import Engine, EngineConfig, Request
from aiomm.samples import encode, photo_like
stamps["aiomm"] = time.perf_counter()
engine = Engine.from_pretrained("qwen2-vl", EngineConfig(device="cpu"))
stamps["processor"] = time.perf_counter()
data = encode(photo_like(np.random.default_rng(0), 480, 640))
prompt = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|> describe<|im_end|>"

async def main():
    async with engine:
        stamps["open"] = time.perf_counter()
        result = await engine.process(Request(prompt=prompt, images=[data]))
        assert result.ok, result.error
        stamps["result"] = time.perf_counter()

anyio.run(main)
print(json.dumps(stamps))
"""


def _env() -> dict[str, str]:
    # the repo root must not be on sys.path: its top-level kernels/ would shadow transformers'
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def phases_once() -> dict[str, float]:
    """One fresh process: seconds spent in each phase, and from spawn to the first result."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-P", "-c", _CHILD],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
        cwd=Path.home(),
    )
    stamps = json.loads(out.stdout.strip().splitlines()[-1])
    record, before = {}, t0
    for name in PHASES:
        record[name] = stamps[name] - before
        before = stamps[name]
    record["first_result"] = stamps["result"] - t0
    return record


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


def run(runs: int) -> dict[str, Any]:
    """Medians over ``runs`` interleaved runs of both timings."""
    phase_runs, cli_runs = [], []
    for _ in range(runs):
        phase_runs.append(phases_once())
        cli_runs.append(cli_once())
    keys = [*PHASES, "first_result"]
    return {
        "runs": runs,
        "median_s": {k: statistics.median(r[k] for r in phase_runs) for k in keys},
        "aiomm_run_samples_1_s": statistics.median(cli_runs),
        "all": {"phases": phase_runs, "cli": cli_runs},
    }


def report(record: dict[str, Any]) -> str:
    m = record["median_s"]
    lines = [f"start-up, median of {record['runs']} fresh processes (s):"]
    labels = {
        "python": "interpreter start",
        "torch": "import torch",
        "transformers": "import transformers",
        "torchvision": "import torchvision (-> torch._dynamo)",
        "aiomm": "import aiomm",
        "processor": "build the embedded default",
        "open": "open the engine",
        "result": "first request",
        "first_result": "spawn -> first result",
    }
    for key, label in labels.items():
        lines.append(f"  {label:<40} {m[key]:6.2f}")
    lines.append(f"  {'aiomm run --samples 1 (whole command)':<40} "
                 f"{record['aiomm_run_samples_1_s']:6.2f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    record = run(args.runs)
    print(report(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
