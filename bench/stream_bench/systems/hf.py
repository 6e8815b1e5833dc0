"""``hf-sequential`` (the HF processor on the event loop) and ``hf-threads`` (``to_thread``)."""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..loadgen import Done, MakeServer, TaskServer, drive
from ..processors import hf_processor, pil, small_image
from ..workload import Workload, WorkRequest, arrive, load_workload, prompt_for


def hf_server_factory(wl: Workload, threaded: bool) -> MakeServer:
    """Servers decoding with Pillow, then calling the HF processor per request."""
    base = hf_processor()
    base(text=[prompt_for(1, "describe")], images=[small_image()], return_tensors="pt")
    local = threading.local()

    def processor() -> Any:
        if not threaded:
            return base
        # HF fast tokenizers are not thread-safe: one processor per worker thread
        proc = getattr(local, "proc", None)
        if proc is None:
            proc = local.proc = copy.deepcopy(base)
        return proc

    def process(req: WorkRequest) -> Done:
        images = [pil(data) for data in req.images]
        out = processor()(text=[req.prompt], images=images, return_tensors="pt")
        if out["pixel_values"].shape[0] == 0:
            raise RuntimeError("no pixel values")
        return Done(time.perf_counter(), images=len(images))

    async def handle(req: WorkRequest) -> Done:
        if threaded:
            return await asyncio.to_thread(process, req)
        return process(req)

    return lambda: TaskServer(functools.partial(arrive, wl), handle)


def run_hf(job: dict[str, Any]) -> dict[str, Any]:
    """The closed and open loops of ``job['system']``, with its thread settings."""
    wl = load_workload(Path(job["workload"]))
    name = job["system"]
    out = drive(job, hf_server_factory(wl, threaded=name == "hf-threads"), len(wl.requests))
    out["settings"] = {
        "torch_threads": torch.get_num_threads(),
        # asyncio's default executor size
        "executor_threads": min(32, (os.cpu_count() or 1) + 4) if name == "hf-threads" else 0,
    }
    return out
