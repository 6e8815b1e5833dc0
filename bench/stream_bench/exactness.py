"""The decode + resize floor, and aiomm's outputs checked against the reference HF processor."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiomm import Engine, EngineConfig, Request
from aiomm.adapters.qwen_vl import smart_resize
from aiomm.media.image import DEFAULT_MAX_PIXELS, decode_image
from aiomm.processing.image_ops import Backend, Resample, resize
from aiomm.tuning.malloc import tune_malloc
from aiomm.tuning.pillow import keep_pillow_blocks

from .loadgen import run_async
from .measure import cores
from .processors import MODEL, aiomm_processor, hf_processor, pil
from .workload import Workload, ids_sha, load_workload

#: max error of the normalised float32 output relative to the reference's largest magnitude
NORM_RTOL = 1e-6


def _target_size(hf: Any, height: int, width: int) -> tuple[int, int]:
    ip = hf.image_processor
    size = ip.size
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    factor = int(ip.patch_size) * int(ip.merge_size)
    return smart_resize(
        height,
        width,
        factor=factor,
        min_pixels=int(get("shortest_edge")),
        max_pixels=int(get("longest_edge")),
    )


def measure_floor(wl: Workload, n: int) -> dict[str, Any]:
    """Single-thread time of decode + resize (the engine's own functions) per unique image."""
    # decode as the engine does: Pillow's memory blocks kept for reuse, malloc tuned
    keep_pillow_blocks(4 * cores())
    tune_malloc()
    hf = hf_processor()
    resample = Resample(int(hf.image_processor.resample))
    reqs = wl.requests[:n]
    unique = sorted({k for r in reqs for k in r.images})
    total_images = sum(len(r.images) for r in reqs)
    torch.set_num_threads(1)
    decode_s = resize_s = 0.0
    wall = time.perf_counter()
    for k in unique:
        # CPU time of this thread: what the work costs, whatever else the machine runs
        t = time.thread_time()
        array = decode_image(wl.data[k], max_pixels=DEFAULT_MAX_PIXELS)
        t1 = time.thread_time()
        height, width = _target_size(hf, array.shape[0], array.shape[1])
        resize(array, height, width, resample, Backend.TORCHVISION)
        t2 = time.thread_time()
        decode_s += t1 - t
        resize_s += t2 - t1
    wall = time.perf_counter() - wall
    floor_s = (decode_s + resize_s) / cores()
    return {
        "unique_images": len(unique),
        "images": total_images,
        "decode_s": decode_s,
        "resize_s": resize_s,
        "wall_s": wall,
        "cores": cores(),
        "floor_s": floor_s,
        "cpu_ms_per_image": (decode_s + resize_s) / total_images * 1000,
        "images_per_s": total_images / floor_s if floor_s else math.nan,
    }


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def check_exact(wl: Workload, indices: Sequence[int], loop: str) -> dict[str, Any]:
    """aiomm against the HF processor on ``indices``.

    aiomm's uint8 pixels, grids and token ids must equal HF's with ``do_rescale=False,
    do_normalize=False``; the engine's normalised float32 output must be within
    :data:`NORM_RTOL` of HF's normalised output.
    """
    processor = aiomm_processor()
    hf = processor.hf_processor
    rows, references = [], {}
    for i in indices:
        req = wl.requests[i]
        pils = [pil(wl.data[k]) for k in req.images]
        raw = hf(
            text=[req.prompt],
            images=pils,
            do_rescale=False,
            do_normalize=False,
            return_tensors="pt",
        )
        ref = hf(text=[req.prompt], images=pils, return_tensors="pt")
        references[i] = ref
        ids = hf.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        arrays = [decode_image(wl.data[k], max_pixels=DEFAULT_MAX_PIXELS) for k in req.images]
        out = processor.apply(ids, {"image": arrays})
        merged = out.merged_kwargs()
        u8, raw_pv = merged["pixel_values"], raw["pixel_values"]
        rows.append(
            {
                "request": i,
                "images": len(req.images),
                "uint8": u8.dtype == torch.uint8,
                "pixels_equal": bool(torch.equal(raw_pv, raw_pv.round()))
                and bool(torch.equal(u8.to(torch.float32), raw_pv.to(torch.float32))),
                "grid_equal": bool(torch.equal(merged["image_grid_thw"], raw["image_grid_thw"])),
                "tokens_equal": out.prompt_token_ids == raw["input_ids"][0].tolist(),
                "prompt_ids_sha": ids_sha(out.prompt_token_ids),
                "num_tokens": len(out.prompt_token_ids),
                # items may keep one frame of rows: hash them as the model takes them
                "image_sha": [
                    _sha(it.fields["pixel_values"].expanded(it.data["pixel_values"]).flatten(1))
                    for it in out.mm_kwargs["image"]
                ],
                "placeholders": [r.length for r in out.mm_placeholders["image"]],
            }
        )

    async def through_engine() -> list[Any]:
        config = EngineConfig(
            device="cpu", visual_dtype="float32", cache_capacity_bytes=0, torch_threads=1
        )
        requests = [
            Request(
                prompt=wl.requests[i].prompt, images=[wl.data[k] for k in wl.requests[i].images]
            )
            for i in indices
        ]
        async with Engine(processor, config, adapter_id=MODEL) as engine:
            async with engine.stream(requests) as results:
                return [r async for r in results]

    for row, result in zip(rows, run_async(through_engine, loop), strict=True):
        ref = references[row["request"]]
        ok = result.ok and result.pixel_values is not None
        row["engine_ok"] = ok
        if ok:
            diff = (result.pixel_values.float() - ref["pixel_values"].float()).abs().max().item()
            scale = ref["pixel_values"].abs().max().item()
            row["norm_max_abs_err"] = diff
            row["norm_rel_err"] = diff / scale if scale else diff
            row["engine_tokens_equal"] = result.prompt_token_ids == ref["input_ids"][0].tolist()
        row["exact"] = bool(
            ok
            and row["uint8"]
            and row["pixels_equal"]
            and row["grid_equal"]
            and row["tokens_equal"]
            and row.get("engine_tokens_equal")
            and row.get("norm_rel_err", math.inf) <= NORM_RTOL
        )
    return {
        "exact": all(r["exact"] for r in rows) and bool(rows),
        "requests": len(rows),
        "images": sum(r["images"] for r in rows),
        "max_norm_rel_err": max((r.get("norm_rel_err", math.inf) for r in rows), default=math.nan),
        "rows": rows,
    }


def run_checks(job: dict[str, Any]) -> dict[str, Any]:
    """The floor over the job's requests and the exactness check on its sample."""
    wl = load_workload(Path(job["workload"]))
    return {
        "status": "ok",
        "floor": measure_floor(wl, job["requests"]),
        "exact": check_exact(wl, job["exact_requests"], job["loop"]),
    }
