"""``--gpu``: aiomm with its device stage on CUDA: bytes moved, copy and fused-kernel times."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .loadgen import drive
from .processors import aiomm_processor, warm_processor
from .systems.aiomm import aiomm_server
from .workload import load_workload


def _timed(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median seconds of ``fn`` on the current CUDA stream, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return float(np.median(times))


def run_gpu(job: dict[str, Any]) -> dict[str, Any]:
    """aiomm with the device stage on CUDA; uint8 transfer bytes against bf16 and fp32."""
    if not torch.cuda.is_available():
        return {
            "status": "skipped",
            "reason": "no CUDA device (torch.cuda.is_available() is "
            "False); run --gpu on a CUDA machine",
        }
    wl = load_workload(Path(job["workload"]))
    processor = aiomm_processor()
    settings = {k: job[k] for k in ("threads", "max_in_flight", "queue_bound", "cache")}
    make = aiomm_server(wl, processor, device="cuda", **settings)
    out = drive({**job, "open_factors": []}, make, len(wl.requests))
    out["settings"] = {**settings, "device": "cuda"}
    moved = out["closed"]["engine"]["bytes_to_device"]
    out["transfer"] = {
        "uint8_bytes": moved,
        "bf16_bytes": 2 * moved,
        "fp32_bytes": 4 * moved,
        "saved_vs_bf16_bytes": moved,
        "saved_vs_bf16": 0.5,
    }
    # one representative image (1920x1080 -> 4888 x 1176 rows): copies and the fused kernel
    x = torch.randint(0, 256, (4888, 1176), dtype=torch.uint8)
    dev = torch.device("cuda")
    params = warm_processor(processor).normalization
    module = params.module().to(dev)
    pinned_u8 = x.pin_memory()
    pinned_bf16 = x.to(torch.bfloat16).pin_memory()
    layout = params.layout
    xd = x.to(dev)
    out["probe"] = {
        "shape": list(x.shape),
        "h2d_pageable_uint8_s": _timed(lambda: x.to(dev)),
        "h2d_pinned_uint8_s": _timed(lambda: pinned_u8.to(dev, non_blocking=True)),
        "h2d_pinned_bf16_s": _timed(lambda: pinned_bf16.to(dev, non_blocking=True)),
        "fused_norm_s": _timed(lambda: module(xd, torch.bfloat16, layout=layout)),
    }
    return out
