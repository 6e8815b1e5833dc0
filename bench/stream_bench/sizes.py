"""``aiomm bench --sizes 512,1024,2048``: throughput per image-size class, and the fast mode.

Per size class (the longest edge; square-ish and 4:3 photo aspect ratios, JPEG and PNG, one
image a request, as chat traffic sends them), side by side in one process and one run:

- ``aiomm float32``: ``Engine.process`` on the CPU device, the model's normalised float32 rows;
- ``aiomm uint8``: the CPU work of a GPU deployment: the engine's items (``return_items``: the
  transform's compact uint8 rows, no CPU merge) copied into one reused staging buffer, as the
  device stage copies them into pinned memory before the H2D copy and the normalise kernel;
- ``hf-threads``: Pillow decode, then the HF processor per request in ``asyncio.to_thread``;
- ``vllm`` (with ``--vllm-python``): vLLM 0.33's processor path (``bench/_vllm_worker.py``: Pillow
  decode in a media pool, ``processor.apply`` on the event loop), run once per class in its own
  environment after the interleaved runs;
- ``floor``: the single-thread CPU time of decode + resize alone (the engine's own functions),
  divided by the cores: the ideal of a machine with every core free;
- ``floor (run)``: the same decode + resize run for real in the transform threads, interleaved
  with the systems, so a shared machine's other load slows it as it slows them (``x floor run``
  is the fair ratio there; ``CPU floor/sys`` is the floor's CPU per image over the system's).

Images/s is wall-clock throughput with ``concurrency`` requests in flight, after one warm-up
request; CPU ms per image is the process's CPU time over the images (the figure least disturbed
by other work on a shared machine). Each system runs ``repeats`` interleaved times and keeps its
best throughput. The item cache is off (every image is unique anyway). A class holds
:func:`images_per_class` images by default (about 64 MP of pixels, at least 24), so a run of
small images lasts long enough that starting and draining the threads do not decide it: with 24
images of 512 px a run lasted 0.07 s and read 0.85 of the floor run where 300 images read 0.35-0.47.

The fixed cost per request is aiomm (uint8 rows) on 56-px JPEGs, the smallest image the embedded
default takes as it is (4 tokens, decode and resize about 0.1 ms): what the engine spends on a
request besides decode and resize, in all threads and on the event loop alone.

The fast-mode table compares ``DecodeConfig(fidelity="fast")`` with ``exact`` (uint8 rows) at the
adapter's pixel budget (``size.longest_edge``; Qwen2-VL's embedded default is 1280 * 28 * 28, the
setting Qwen documents for serving): fast mode only changes JPEGs whose resize target is at most
half the source, so PNGs and images already within half the budget are unchanged; the class's
JPEGs alone (photos) are timed too. PSNR is of the fast rows against the exact rows, per changed
image (mean and worst).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiomm import Engine, EngineConfig, Request
from aiomm.config import DecodeConfig
from aiomm.media.image import DEFAULT_MAX_PIXELS, decode_image
from aiomm.media.samples import encode, photo_like
from aiomm.processing.image_ops import Backend, Resample, resize
from aiomm.tuning import tuned
from aiomm.tuning.malloc import tune_malloc
from aiomm.tuning.pillow import keep_pillow_blocks

from .exactness import _target_size
from .measure import cores
from .processors import aiomm_processor, pil, small_image
from .workload import prompt_for

PROMPT = prompt_for(1, "describe")


@dataclass(frozen=True)
class SizeClass:
    """The encoded images of one size class."""

    size: int
    images: list[bytes]
    shapes: list[tuple[int, int]]
    formats: list[str]


def make_class(size: int, n: int, seed: int) -> SizeClass:
    """``n`` photo-like images of longest edge ``size``: square-ish and 4:3, two JPEGs a PNG."""
    rng = np.random.default_rng([seed, size])
    images, shapes, formats = [], [], []
    for i in range(n):
        if i % 2:
            h, w = size * 3 // 4, size  # photo, landscape
        else:
            h, w = int(size * rng.uniform(0.9, 1.0)), size  # square-ish
        if i % 4 == 3:
            h, w = w, h  # some portraits
        fmt = "PNG" if i % 3 == 2 else "JPEG"
        images.append(encode(photo_like(rng, h, w), fmt))
        shapes.append((h, w))
        formats.append(fmt)
    return SizeClass(size, images, shapes, formats)


#: the pixels a size class holds by default (see :func:`images_per_class`)
CLASS_PIXELS = 64 << 20
#: the edge of the fixed-cost probe's images: Qwen2-VL's smallest unresized image (56 x 56)
FIXED_COST_EDGE = 56


def images_per_class(size: int) -> int:
    """Images of a ``size`` class by default: about :data:`CLASS_PIXELS` pixels, 24 to 400."""
    return min(400, max(24, CLASS_PIXELS // (size * size)))


@dataclass
class Run:
    """One system's best run over a size class."""

    images_per_s: float
    cpu_ms_per_image: float
    #: CPU of the thread that ran the event loop (the driver's), per image
    loop_cpu_ms_per_image: float | None = None


async def _drive(items: Sequence[Any], one: Callable[[Any], Awaitable[Any]], limit: int) -> Run:
    """``items`` through ``one``, ``limit`` at a time: throughput and process CPU per item."""
    sem = asyncio.Semaphore(limit)

    async def go(item: Any) -> Any:
        async with sem:
            return await one(item)

    cpu, t, loop = time.process_time(), time.perf_counter(), time.thread_time()
    await asyncio.gather(*(go(i) for i in items))
    wall, cpu_s = time.perf_counter() - t, time.process_time() - cpu
    n = len(items)
    return Run(n / wall, cpu_s / n * 1000, (time.thread_time() - loop) / n * 1000)


def _best(runs: list[Run]) -> Run:
    # other tenants of a shared machine only slow a run down: keep the fastest, and its CPU
    return max(runs, key=lambda r: r.images_per_s)


class Systems:
    """The systems of the table, built once and reused for every size class."""

    def __init__(self, threads: int, concurrency: int) -> None:
        self.threads = threads
        self.concurrency = concurrency
        self.processor = aiomm_processor()
        self.hf = self.processor.hf_processor
        self.hf(text=[PROMPT], images=[small_image()], return_tensors="pt")
        self._local = threading.local()

    def _engine(self, *, staged: bool = False, **decode: Any) -> Engine:
        config = tuned(
            EngineConfig(
                device="cpu",
                visual_dtype="float32",
                transform_threads=self.threads,
                cache_capacity_bytes=0,
                decode=DecodeConfig(**decode),
                return_items=staged,
            )
        )
        return Engine(self.processor, config)

    def aiomm(self, images: list[bytes], *, device: bool, **decode: Any) -> Run:
        """``device=True``: normalised float32 rows; ``device=False``: the uint8 rows a GPU
        deployment ships (each item's rows copied into a reused staging buffer)."""
        kwargs = decode.pop("kwargs", None)
        staging = torch.empty(0, dtype=torch.uint8)

        def stage(items: Sequence[Any]) -> None:
            nonlocal staging
            for item in items:
                rows = item.data["pixel_values"]
                if rows.dtype != torch.uint8:
                    raise RuntimeError(f"the transform made {rows.dtype} rows, not uint8")
                if staging.numel() < rows.numel():
                    staging = torch.empty(rows.numel(), dtype=torch.uint8)
                staging[: rows.numel()].view(rows.shape).copy_(rows)

        async def main() -> Run:
            async with self._engine(staged=not device, **decode) as engine:

                async def one(data: bytes) -> Any:
                    request = Request(prompt=PROMPT, images=[data], mm_processor_kwargs=kwargs)
                    result = await engine.process(request)
                    if not result.ok:
                        raise RuntimeError(f"aiomm failed: {result.error}")
                    if not device:
                        stage(result.items)
                    return result

                await one(images[0])  # warm the worker threads
                return await _drive(images, one, self.concurrency)

        return asyncio.run(main())

    def rows(self, images: list[bytes], **decode: Any) -> list[torch.Tensor]:
        """The uint8 rows of every image (for the PSNR), with the cache off."""
        kwargs = decode.pop("kwargs", None)

        async def main() -> list[torch.Tensor]:
            async with self._engine(**decode) as engine:
                out = []
                for data in images:
                    request = Request(prompt=PROMPT, images=[data], mm_processor_kwargs=kwargs)
                    result = await engine.process(request, device=False)
                    if not result.ok:
                        raise RuntimeError(f"aiomm failed: {result.error}")
                    out.append(result.pixel_values)
                return out

        return asyncio.run(main())

    def hf_threads(self, images: list[bytes]) -> Run:
        def processor() -> Any:
            # HF fast tokenizers are not thread-safe: one processor per worker thread
            proc = getattr(self._local, "proc", None)
            if proc is None:
                proc = self._local.proc = copy.deepcopy(self.hf)
            return proc

        def process(data: bytes) -> Any:
            out = processor()(text=[PROMPT], images=[pil(data)], return_tensors="pt")
            if out["pixel_values"].shape[0] == 0:
                raise RuntimeError("no pixel values")

        async def one(data: bytes) -> Any:
            return await asyncio.to_thread(process, data)

        async def main() -> Run:
            await one(images[0])  # warm the worker threads
            return await _drive(images, one, self.concurrency)

        return asyncio.run(main())

    def _decode_resize(self, data: bytes) -> None:
        array = decode_image(data, max_pixels=DEFAULT_MAX_PIXELS)
        height, width = _target_size(self.hf, array.shape[0], array.shape[1])
        # the fastest resize aiomm has (the one its Qwen-VL transform runs)
        resize(array, height, width, self._resample, Backend.TORCHVISION, scratch=True)

    @property
    def _resample(self) -> Resample:
        return Resample(int(self.hf.image_processor.resample))

    def floor(self, images: list[bytes]) -> Run:
        """Single-thread CPU time of decode + resize alone, over the cores (the ideal: every
        transform thread busy on a machine of its own)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cpu_s = 0.0
            for data in images:
                t = time.thread_time()
                self._decode_resize(data)
                cpu_s += time.thread_time() - t
        finally:
            torch.set_num_threads(threads)
        n = len(images)
        return Run(n / (cpu_s / self.threads), cpu_s / n * 1000)

    def floor_run(self, images: list[bytes]) -> Run:
        """Decode + resize alone, run for real in ``threads`` threads: the floor under the same
        machine load as the systems it is interleaved with."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(self._decode_resize, images[:1]))  # warm the threads
                cpu, t = time.process_time(), time.perf_counter()
                list(pool.map(self._decode_resize, images))
                wall, cpu_s = time.perf_counter() - t, time.process_time() - cpu
        finally:
            torch.set_num_threads(threads)
        return Run(len(images) / wall, cpu_s / len(images) * 1000)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR (dB) of uint8 rows ``b`` against ``a``; inf when equal."""
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def vllm_run(
    sc: SizeClass, python: str, out: Path, *, threads: int, concurrency: int, seed: int
) -> Run | None:
    """vLLM's own processor path (``bench/_vllm_worker.py`` in ``python``'s environment) on the
    class's images, one a request, the same closed loop; None (and the reason printed) when the
    worker fails."""
    from .systems.vllm import run_vllm

    folder = out / f"vllm_sizes_{sc.size}"
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for k, (data, fmt) in enumerate(zip(sc.images, sc.formats, strict=True)):
        name = f"img_{k:05d}.{'png' if fmt == 'PNG' else 'jpg'}"
        (folder / name).write_bytes(data)
        images.append({"file": name, "format": fmt})
    requests = [{"prompt": PROMPT, "images": [k]} for k in range(len(images))]
    (folder / "manifest.json").write_text(json.dumps({"images": images, "requests": requests}))
    job = {
        "workload": str(folder),
        "vllm_cache": "none",  # every image is unique; aiomm's cache is off too
        "media_threads": threads,
        "loop": "uvloop",
        "requests": len(images),
        "concurrency": concurrency,
        "open_factors": [],
        "seed": seed,
        "window_s": 0.0,
        "drain_s": 0.0,
        "exact_requests": [],
    }
    rec = run_vllm(job, python, out)
    if rec.get("status") != "ok":
        print(f"vllm at {sc.size}: {rec.get('status')}: {rec.get('reason')}")
        return None
    closed = rec["closed"]
    return Run(closed["images_per_s"], closed["cpu_s"] / max(1, closed["images"]) * 1000)


def fixed_cost_images(n: int, seed: int) -> list[bytes]:
    """``n`` distinct JPEGs of :data:`FIXED_COST_EDGE` px (decode and resize cost ~nothing)."""
    rng = np.random.default_rng([seed, FIXED_COST_EDGE])
    edge = FIXED_COST_EDGE
    return [encode(photo_like(rng, edge, edge), "JPEG") for _ in range(n)]


def run_sizes(
    sizes: Sequence[int],
    *,
    per_class: int | None = None,
    threads: int | None = None,
    concurrency: int = 8,
    repeats: int = 3,
    seed: int = 0,
    vllm_python: str | None = None,
    out: Path | None = None,
) -> dict[str, Any]:
    """Measure every size class; a JSON-friendly record (see :func:`report_sizes`).

    ``per_class``: images per class (default :func:`images_per_class`). With ``vllm_python``
    (a vLLM 0.33 environment's interpreter) vLLM's processor path is measured on every class too
    (its worker writes under ``out``).
    """
    threads = threads or cores()
    keep_pillow_blocks(4 * threads)
    tune_malloc()
    systems = Systems(threads, concurrency)
    classes = []
    tiny = fixed_cost_images(per_class or 400, seed)
    fixed = _best([systems.aiomm(tiny, device=False) for _ in range(repeats)])
    for size in sizes:
        sc = make_class(size, per_class or images_per_class(size), seed)
        n = len(sc.images)
        runs: dict[str, list[Run]] = {
            "aiomm float32": [],
            "aiomm uint8": [],
            "hf-threads": [],
            "floor (run)": [],
        }
        fast: dict[str, list[Run]] = {"exact": [], "fast": []}
        # photos alone: the mode only changes JPEGs, so the mixed class dilutes its effect
        jpegs = [im for im, fmt in zip(sc.images, sc.formats, strict=True) if fmt == "JPEG"]
        fast_jpeg: dict[str, list[Run]] = {"exact": [], "fast": []}
        for _ in range(repeats):  # interleaved, so a busy moment hits every system alike
            runs["aiomm float32"].append(systems.aiomm(sc.images, device=True))
            runs["aiomm uint8"].append(systems.aiomm(sc.images, device=False))
            runs["hf-threads"].append(systems.hf_threads(sc.images))
            runs["floor (run)"].append(systems.floor_run(sc.images))
            for fidelity, runs_of in fast.items():
                runs_of.append(systems.aiomm(sc.images, device=False, fidelity=fidelity))
            for fidelity, runs_of in fast_jpeg.items():
                if jpegs:
                    runs_of.append(systems.aiomm(jpegs, device=False, fidelity=fidelity))
        floor = systems.floor(sc.images)
        best = {k: _best(v) for k, v in runs.items()}
        # each round's aiomm uint8 run against the floor run right after it: the machine's
        # speed drifts by more than the gap between them, so best against best can pair a
        # fast moment of one with a slow moment of the other
        paired = [
            u.images_per_s / f.images_per_s
            for u, f in zip(runs["aiomm uint8"], runs["floor (run)"], strict=True)
        ]
        if vllm_python:
            vllm = vllm_run(
                sc,
                vllm_python,
                out or Path("results/stream_bench"),
                threads=threads,
                concurrency=concurrency,
                seed=seed,
            )
            if vllm is not None:
                best["vllm"] = vllm
        best_fast = {k: _best(v) for k, v in fast.items()}
        exact_rows = systems.rows(sc.images, fidelity="exact")
        fast_rows = systems.rows(sc.images, fidelity="fast")
        values = [psnr(a, b) for a, b in zip(exact_rows, fast_rows, strict=True)]
        finite = [v for v in values if math.isfinite(v)]
        quality = {
            "psnr_mean_db": float(np.mean(finite)) if finite else math.inf,
            "psnr_worst_db": min(values),
            "changed": len(finite),
        }
        classes.append(
            {
                "size": size,
                "images": n,
                "jpeg": sc.formats.count("JPEG"),
                "png": sc.formats.count("PNG"),
                "mean_mp": float(np.mean([h * w for h, w in sc.shapes])) / 1e6,
                "systems": {k: vars(v) for k, v in best.items()} | {"floor": vars(floor)},
                "fast": {k: vars(v) for k, v in best_fast.items()},
                "fast_jpeg": {k: vars(_best(v)) for k, v in fast_jpeg.items() if v},
                "quality": quality,
                "uint8_per_floor_run": {"rounds": paired, "median": float(np.median(paired))},
            }
        )
    return {
        "threads": threads,
        "cores": cores(),
        "concurrency": concurrency,
        "repeats": repeats,
        "max_pixels": int(_size_edge(systems.hf, "longest_edge")),
        "fixed_cost": {"edge": FIXED_COST_EDGE, "requests": len(tiny), **vars(fixed)},
        "classes": classes,
    }


def _size_edge(hf: Any, key: str) -> Any:
    size = hf.image_processor.size
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def report_sizes(record: dict[str, Any]) -> str:
    """The size-class table and the fast-mode table, as text."""
    lines = [
        f"size classes: {record['threads']} transform threads, {record['cores']} cores, "
        f"{record['concurrency']} requests in flight, best of {record['repeats']} interleaved runs",
        "",
        f"{'class':>6} {'MP':>5} {'system':<14} {'img/s':>8} {'CPU ms/img':>11} "
        f"{'x hf-thr':>9} {'x floor':>8} {'x floor run':>12} {'CPU floor/sys':>14}",
    ]
    fixed = record.get("fixed_cost")
    if fixed:
        lines[1:1] = [
            f"fixed cost per request (aiomm uint8, {fixed['requests']} JPEGs of {fixed['edge']} px,"
            f" decode + resize ~0.1 ms): {fixed['images_per_s']:.0f} requests/s, "
            f"{fixed['cpu_ms_per_image']:.2f} ms CPU per request, "
            f"{fixed['loop_cpu_ms_per_image']:.2f} ms of it on the event loop",
        ]
    for c in record["classes"]:
        s = c["systems"]
        hf, floor = s["hf-threads"]["images_per_s"], s["floor"]["images_per_s"]
        run = s["floor (run)"]["images_per_s"]
        floor_cpu = s["floor"]["cpu_ms_per_image"]
        for name in ("aiomm float32", "aiomm uint8", "hf-threads", "vllm", "floor (run)", "floor"):
            if name not in s:
                continue
            r = s[name]
            lines.append(
                f"{c['size']:>6} {c['mean_mp']:>5.2f} {name:<14} {r['images_per_s']:>8.1f} "
                f"{r['cpu_ms_per_image']:>11.2f} {r['images_per_s'] / hf:>9.2f} "
                f"{r['images_per_s'] / floor:>8.2f} {r['images_per_s'] / run:>12.2f} "
                f"{floor_cpu / r['cpu_ms_per_image']:>14.2f}"
            )
    for c in record["classes"]:
        paired = c.get("uint8_per_floor_run")
        if paired:
            rounds = " ".join(f"{r:.2f}" for r in paired["rounds"])
            lines.append(
                f"{c['size']:>6}: aiomm uint8 / floor run, round by round: {rounds} "
                f"(median {paired['median']:.2f})"
            )
    for c in record["classes"]:
        s = c["systems"]
        if "vllm" in s:
            a, v = s["aiomm uint8"], s["vllm"]
            speed = a["images_per_s"] / v["images_per_s"]
            cpu = a["cpu_ms_per_image"] / v["cpu_ms_per_image"]
            lines.append(
                f"{c['size']:>6}: aiomm uint8 / vllm images/s x{speed:.2f}, CPU/image x{cpu:.2f}"
            )
    lines += [
        "",
        "fast mode: DecodeConfig(fidelity='fast') vs 'exact', uint8 rows, adapter budget "
        f"max_pixels={record['max_pixels']}; PSNR of fast vs exact rows over the changed images",
        f"{'class':>6} {'images':<10} {'exact img/s':>12} {'fast img/s':>11} {'ratio':>6} "
        f"{'PSNR mean':>10} {'worst':>7} {'changed':>8}",
    ]
    for c in record["classes"]:
        q = c["quality"]
        e, x = c["fast"]["exact"]["images_per_s"], c["fast"]["fast"]["images_per_s"]
        lines.append(
            f"{c['size']:>6} {'all':<10} {e:>12.1f} {x:>11.1f} {x / e:>6.2f} "
            f"{q['psnr_mean_db']:>10.1f} {q['psnr_worst_db']:>7.1f} "
            f"{q['changed']:>4}/{c['images']}"
        )
        if c.get("fast_jpeg"):
            e, x = (c["fast_jpeg"][k]["images_per_s"] for k in ("exact", "fast"))
            lines.append(f"{c['size']:>6} {'JPEG only':<10} {e:>12.1f} {x:>11.1f} {x / e:>6.2f}")
    return "\n".join(lines)
