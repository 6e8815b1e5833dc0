"""One job per system (and the checks, sweep and GPU run), in this process or a child of its own.

A child is ``python bench/stream_bench --child JOB.json``; it writes ``JOB.result.json`` next to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from aiomm.logging import configure_logging

from .exactness import run_checks
from .gpu import run_gpu
from .loadgen import json_safe
from .systems.aiomm import run_aiomm
from .systems.hf import run_hf
from .tuning import run_sweep

#: run as a folder, not with -m: -m would put the working directory on the child's sys.path
_PACKAGE_DIR = Path(__file__).resolve().parent


def execute(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job here; any exception becomes a ``failed`` record with its traceback."""
    threads = torch.get_num_threads()
    try:
        kind = job["kind"]
        if kind == "checks":
            return run_checks(job)
        if kind == "system":
            return run_aiomm(job) if job["system"] == "aiomm" else run_hf(job)
        if kind == "sweep":
            return run_sweep(job)
        if kind == "gpu":
            return run_gpu(job)
        raise ValueError(f"unknown job kind {kind!r}; expected checks, system, sweep or gpu")
    except Exception as exc:
        return {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
    finally:
        # jobs set torch's thread count for their system: the next in-process job starts afresh
        torch.set_num_threads(threads)


def run_child(job_path: str) -> int:
    """The child's side: run the job in ``job_path`` and write its result next to it."""
    configure_logging(level="WARNING")
    path = Path(job_path)
    result = execute(json.loads(path.read_text()))
    path.with_suffix(".result.json").write_text(json.dumps(json_safe(result)))
    return 0


def run_job(job: dict[str, Any], out: Path, isolate: bool, name: str) -> dict[str, Any]:
    """Run ``job`` in this process, or (``isolate``) in a child, printing its progress."""
    t = time.perf_counter()
    print(f"  {name} ...", end="", flush=True, file=sys.stderr)
    if not isolate:
        result = execute(job)
    else:
        jobs = out / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        path = jobs / f"{name}.json"
        path.write_text(json.dumps(job))
        result_path = path.with_suffix(".result.json")
        result_path.unlink(missing_ok=True)
        proc = subprocess.run(
            [sys.executable, str(_PACKAGE_DIR), "--child", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result_path.is_file():
            result = json.loads(result_path.read_text())
        else:
            result = {
                "status": "failed",
                "reason": f"child exited {proc.returncode}",
                "traceback": proc.stderr[-4000:],
            }
    print(f" {result.get('status')} ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    return result
