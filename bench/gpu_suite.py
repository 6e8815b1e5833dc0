"""One run that checks and measures the device stage; writes results.md and results.json.

    python bench/gpu_suite.py RESULTS_DIR [--quick] [--seed N] [--only SECTION,...]

Everything goes under ``RESULTS_DIR`` (``results.md``, ``results.json`` with each failure's
traceback); the console ends with the summary table, and the exit status is 1 if any section
failed or mismatched. Sections, with the estimated time of a full (not ``--quick``) run on one
H200 with 16 host cores, counted from their sizes (Triton compiles each kernel specialisation once,
about 0.5 s each; the float64 reference runs on the host at roughly 0.3 s per 10M elements):

1. ``native_correctness`` (~5 s): ``forward_native`` against the float64 reference of
   ``tests/support/norm_reference.py``, the tests' one copy (every input and output dtype, three
   layouts, batch padding; 36 combinations, largest input 1.2M elements);
2. ``cuda_correctness`` (~60 s: 60 kernel compilations, 24 float64 references of 10.8M
   elements): ``forward_cuda`` and ``DeviceStage("cuda")`` against the native path on random
   images (every input and output dtype, NCHW/NHWC/PATCHES, NaN-poisoned batch-padded ``out``
   buffers, the classic cast path, concurrent runs); without CUDA, ``cpu_stage_correctness`` runs
   its ``DeviceStage("cpu")`` part;
3. ``h2d_bandwidth`` (~5 s: 1-256 MiB, 20 copies each way): pinned vs pageable host-to-device
   GB/s;
4. ``uint8_vs_bf16`` (~10 s: three images up to 1344x1344, 20 repeats): bytes and time per image
   for the uint8 copy + fused kernel against the bf16 copy of CPU-normalised pixels (and the CPU
   normalise that the device path removes);
5. ``kernel_vs_copy`` (~10 s: four ``do_bench`` pairs of 0.2 s on up to 77M elements): fused
   kernel GB/s against a device-to-device copy of the same bytes;
6. ``device_stage_throughput`` (~20 s: 128 images, 0.8 GB of uint8, 4 passes at each of 4
   concurrencies): images/s of ``DeviceStage.run`` at 1-8 requests in flight, with its CUDA-event
   copy/kernel times and pool occupancy, against a naive pageable copy + sync;
7. ``engine_e2e`` (~30 s, mostly generating 96 JPEGs up to 1080x1920): engine images/s (qwen2-vl,
   offline) with ``mm_device_do_normalize`` True vs False, and how far the two results differ;
8. ``resize_kernel`` (~20 s: three images up to 3024x4032, 10 CPU repeats per variant):
   device resize per image vs the CPU resize it reproduces, bit-exact check;
9. ``engine_device_resize`` (~45 s, mostly generating 96 JPEGs up to 1536x2048): engine images/s
   with resize + patchify on the device vs on the CPU (same outputs).

About 4 minutes in all, with imports and CUDA start-up; the estimate is what this docstring
promises, so keep new sections inside it. ``--quick`` shrinks every size and count (under a
minute on a GPU; on a 2-core CPU, with ``TRITON_INTERPRET=1``, about 15 s).

Each section is guarded: a failure is recorded (with its traceback) and the rest still run; the
result files are rewritten after every section, so a run cut short keeps what it measured. Without
CUDA, sections 1, 2 (its CPU part: the stage against the native path), 7, 8 and 9 run on the CPU
and the report says that the GPU figures need a GPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _support import REPO, load_reference

CLIP = (1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
PROMPT = "<|im_start|>user describe <|vision_start|><|image_pad|><|vision_end|><|im_end|>"
#: every section, in the order of a run; a run on the CPU has ``cpu_stage_correctness`` in place of
#: ``cuda_correctness`` and skips the sections that need a CUDA device
SECTIONS = (
    "native_correctness",
    "cuda_correctness",
    "cpu_stage_correctness",
    "h2d_bandwidth",
    "uint8_vs_bf16",
    "kernel_vs_copy",
    "device_stage_throughput",
    "engine_e2e",
    "resize_kernel",
    "engine_device_resize",
)
NO_GPU = "GPU figures need a CUDA device: this run had none, so only the CPU sections ran."


def ensure_aiomm() -> str:
    """Import aiomm as installed, or else straight from this checkout.

    The fallback loads ``aiomm/``, ``kernels/`` and ``adapters/`` under their installed names
    (``aiomm``, ``aiomm.kernels``, ``aiomm.adapters``) without putting the checkout on
    ``sys.path``, where its ``kernels/`` would shadow Hugging Face's ``kernels`` package.
    """
    try:
        importlib.import_module("aiomm.kernels")
        importlib.import_module("aiomm.adapters")
        return "installed"
    except ImportError:
        for name in [m for m in sys.modules if m == "aiomm" or m.startswith("aiomm.")]:
            del sys.modules[name]
    for name, folder in (("aiomm", "aiomm"), ("aiomm.kernels", "kernels"),
                         ("aiomm.adapters", "adapters")):  # fmt: skip
        spec = importlib.util.spec_from_file_location(
            name, REPO / folder / "__init__.py", submodule_search_locations=[str(REPO / folder)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if "." in name:
            setattr(sys.modules["aiomm"], name.split(".")[1], module)
    return "from the checkout"


# ---------------------------------------------------------------------- the report


class Suite:
    """Runs guarded sections and writes the report after each one."""

    def __init__(
        self,
        out_dir: Path,
        *,
        quick: bool,
        seed: int,
        cuda: bool,
        only: Sequence[str] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.only = None if only is None else frozenset(only)
        self.quick = quick
        self.seed = seed
        self.cuda = cuda
        self.started = time.perf_counter()
        self.environment: dict[str, Any] = {}
        self.sections: list[dict[str, Any]] = []

    def run(self, name: str, title: str, fn: Callable[[dict[str, Any]], None], *,
            needs_cuda: bool = False) -> None:  # fmt: skip
        if self.only is not None and name not in self.only:
            return
        rec: dict[str, Any] = {"name": name, "title": title, "status": "ok", "seconds": 0.0,
                               "rows": [], "notes": []}  # fmt: skip
        self.sections.append(rec)
        if needs_cuda and not self.cuda:
            rec["status"] = "skipped"
            rec["notes"].append("needs a CUDA device")
            self.write()
            return
        print(f"[{time.perf_counter() - self.started:6.1f}s] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            fn(rec)
            if self.cuda:
                import torch

                torch.cuda.synchronize()  # surfaces asynchronous errors inside this section
        except Exception as exc:
            rec["status"] = "failed"
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()
            print(rec["traceback"], file=sys.stderr, flush=True)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        failed_rows = [r for r in rec["rows"] if r.get("ok") is False]
        if failed_rows and rec["status"] == "ok":
            rec["status"] = "mismatch"
        print(f"         {name}: {rec['status']} in {rec['seconds']} s", flush=True)
        self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        report = {
            "suite": "aiomm bench/gpu_suite.py",
            "quick": self.quick,
            "seed": self.seed,
            "cuda": self.cuda,
            "gpu_figures": "measured" if self.cuda else NO_GPU,
            "seconds": round(time.perf_counter() - self.started, 2),
            "environment": self.environment,
            "sections": self.sections,
        }
        (self.out_dir / "results.json").write_text(json.dumps(report, indent=2, default=str))
        (self.out_dir / "results.md").write_text(self.markdown(report))

    def status_table(self) -> str:
        rows = [f"| {s['name']} | {s['status']} | {s['seconds']} |" for s in self.sections]
        return "\n".join(["| section | status | seconds |", "|---|---|---|", *rows])

    def summary(self) -> str:
        """The status of every section, for the end of the console output."""
        failed = sum(s["status"] in ("failed", "mismatch") for s in self.sections)
        verdict = f"{failed} section(s) FAILED" if failed else "no section failed"
        return (
            f"## summary: {verdict}; cuda={self.cuda}, quick={self.quick}, seed={self.seed}, "
            f"{time.perf_counter() - self.started:.1f} s; results in {self.out_dir}\n\n"
            f"{self.status_table()}"
        )

    def markdown(self, report: dict[str, Any]) -> str:
        lines = ["# aiomm device-stage suite", ""]
        if not self.cuda:
            lines += [f"**{NO_GPU}**", ""]
        lines.append(f"quick={self.quick}, seed={self.seed}, {report['seconds']} s in all.")
        lines += ["", table([{"key": k, "value": v} for k, v in self.environment.items()]), ""]
        lines.append(self.status_table())
        for s in self.sections:
            lines += ["", f"## {s['name']}: {s['title']}", "", f"status: **{s['status']}**"]
            if "error" in s:
                lines += ["", f"error: `{s['error']}`"]
            lines += [f"- {note}" for note in s["notes"]]
            if s["rows"]:
                lines += ["", table(s["rows"])]
        return "\n".join(lines) + "\n"


def table(rows: Sequence[dict[str, Any]]) -> str:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        out.append("| " + " | ".join(fmt(row.get(k, "")) for k in keys) + " |")
    return "\n".join(out)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v).replace("|", "/")


# ---------------------------------------------------------------------- timing helpers


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def wall_ms(fn: Callable[[], object], reps: int, *, cuda: bool, warmup: int = 2) -> float:
    """Median wall time of ``fn`` (each rep synchronised when ``cuda``)."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn`` on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_ms(fn: Callable[[], object], quick: bool) -> float:
    """``triton.testing.do_bench`` median (L2 flushed between reps), else CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return event_ms(fn, 10 if quick else 50)
    return float(do_bench(fn, warmup=10, rep=50 if quick else 200, return_mode="median"))


# ---------------------------------------------------------------------- sections


def native_correctness(suite: Suite, rec: dict[str, Any]) -> None:
    import torch

    from aiomm.kernels import FusedMMInputNorm

    tn = load_reference()
    norm = FusedMMInputNorm(*CLIP)
    gen = torch.Generator().manual_seed(suite.seed)
    shapes = {
        "nchw": [(2, 3, 17, 19), (1, 3, 64, 96)],
        "nhwc": [(2, 13, 11, 3)],
        "patches": [(7, 1176), (1, 3)],
    }
    if not suite.quick:
        shapes["nchw"].append((2, 3, 224, 224))
        shapes["patches"].append((1024, 1176))
    for in_dtype in tn.INPUT_DTYPES:
        for out_dtype in tn.OUTPUT_DTYPES:
            for layout, layout_shapes in shapes.items():
                row = {"in": _name(in_dtype), "out": _name(out_dtype), "layout": layout,
                       "cases": 0, "ok": True, "padding_untouched": True}  # fmt: skip
                for shape in layout_shapes:
                    x = tn.random_pixels(shape, in_dtype, gen)
                    ref = tn.reference_norm(x, CLIP[0], CLIP[1], CLIP[2], layout)
                    out = torch.full((shape[0] + 2, *shape[1:]), float("nan"), dtype=out_dtype)
                    y = norm.forward_native(x, out_dtype, out=out, layout=layout)
                    row["cases"] += 1
                    row["padding_untouched"] &= bool(out[shape[0] :].isnan().all())
                    try:
                        tn.assert_matches_reference(y, ref, f"native {layout} {list(shape)}")
                    except AssertionError as exc:
                        row["ok"] = False
                        row["error"] = str(exc)[:200]
                row["ok"] = row["ok"] and row["padding_untouched"]
                rec["rows"].append(row)
    rec["notes"].append("ok: within 1 ulp (bf16/fp16) or 1e-6 relative (fp32) of float64")


def stage_vs_native(suite: Suite, rec: dict[str, Any], device: str) -> None:
    """DeviceStage results on ``device`` against forward_native on the CPU."""
    import anyio
    import torch

    from aiomm.device.stage import DeviceStage
    from aiomm.kernels import ChannelLayout, FusedMMInputNorm
    from aiomm.processing.processor import NormalizationParams

    tn = load_reference()
    norm = FusedMMInputNorm(*CLIP)
    gen = torch.Generator().manual_seed(suite.seed + 1)
    layouts = {
        ChannelLayout.PATCHES: [(97, 1176), (1, 1176)],
        ChannelLayout.NCHW: [(2, 3, 61, 67)],
        ChannelLayout.NHWC: [(1, 31, 37, 3)],
    }
    if not suite.quick:
        layouts[ChannelLayout.PATCHES].append((4096, 1176))
        layouts[ChannelLayout.NCHW].append((2, 3, 448, 448))

    async def check(out_dtype: torch.dtype) -> list[dict[str, Any]]:
        stage = DeviceStage(device, _name(out_dtype, long=True))
        rows = []
        for in_dtype in tn.INPUT_DTYPES:
            row = {"device": device, "path": "norm", "in": _name(in_dtype),
                   "out": _name(out_dtype), "cases": 0, "bitwise_equal": 0, "ok": True}  # fmt: skip
            for layout, shapes in layouts.items():
                params = NormalizationParams(CLIP[0], CLIP[1], CLIP[2], layout)
                for shape in shapes:
                    for padded in (False, True):
                        x = tn.random_pixels(shape, in_dtype, gen)
                        want = norm.forward_native(x, out_dtype, layout=layout)
                        out = None
                        if padded:
                            out = torch.full((shape[0] + 3, *shape[1:]), float("nan"),
                                             dtype=out_dtype, device=device)  # fmt: skip
                        got = (await stage.run(x, params, out=out)).cpu()
                        row["cases"] += 1
                        equal = torch.equal(got, want)
                        row["bitwise_equal"] += equal
                        if not equal:
                            ref = tn.reference_norm(x, *CLIP, layout.value)
                            try:
                                tn.assert_matches_reference(got, ref, f"stage {layout.name}")
                            except AssertionError as exc:
                                row["ok"] = False
                                row["error"] = str(exc)[:200]
                        if out is not None and not bool(out[shape[0] :].isnan().all()):
                            row["ok"] = False
                            row["error"] = "padding rows were written"
            rows.append(row)
        # The classic path: CPU-normalised floats, cast and copied.
        row = {"device": device, "path": "classic", "in": "float32", "out": _name(out_dtype),
               "cases": 0, "bitwise_equal": 0, "ok": True}  # fmt: skip
        for shape in [(97, 1176), (2, 3, 61, 67)]:
            x = torch.randn(shape, generator=gen)
            got = (await stage.run(x, None)).cpu()
            row["cases"] += 1
            row["bitwise_equal"] += torch.equal(got, x.to(out_dtype))
        row["ok"] = row["bitwise_equal"] == row["cases"]
        rows.append(row)
        # Many requests in flight at once: each result is its own.
        xs = [tn.random_pixels((int(n), 1176), torch.uint8, gen)
              for n in torch.randint(1, 600, (24,), generator=gen)]  # fmt: skip
        params = NormalizationParams(CLIP[0], CLIP[1], CLIP[2], ChannelLayout.PATCHES)
        results: dict[int, torch.Tensor] = {}

        async def one(i: int) -> None:
            results[i] = (await stage.run(xs[i], params)).cpu()

        async with anyio.create_task_group() as tg:
            for i in range(len(xs)):
                tg.start_soon(one, i)
        same = sum(
            torch.equal(results[i], norm.forward_native(x, out_dtype, layout="patches"))
            for i, x in enumerate(xs)
        )
        s = stage.statistics()
        rows.append({"device": device, "path": "concurrent x24", "in": "uint8",
                     "out": _name(out_dtype), "cases": len(xs), "bitwise_equal": same,
                     "ok": same == len(xs) and s.pool_in_use == 0,
                     "pool_peak": None if s.pool is None else s.pool.peak_in_use})  # fmt: skip
        return rows

    for out_dtype in tn.OUTPUT_DTYPES:
        rec["rows"] += anyio.run(check, out_dtype)


def cuda_correctness(suite: Suite, rec: dict[str, Any]) -> None:
    import torch

    from aiomm.kernels import FusedMMInputNorm

    tn = load_reference()
    norm = FusedMMInputNorm(*CLIP)
    norm_cuda = FusedMMInputNorm(*CLIP).cuda()
    gen = torch.Generator().manual_seed(suite.seed + 2)
    shapes = {
        "nchw": [(1, 3, 37, 41), (2, 3, 224, 224)],
        "nhwc": [(2, 97, 101, 3)],
        "patches": [(1, 1176), (257, 1176)],
    }
    if not suite.quick:
        shapes["nchw"].append((2, 3, 1344, 1344))
        shapes["patches"].append((9216, 1176))
    for in_dtype in tn.INPUT_DTYPES:
        for out_dtype in tn.OUTPUT_DTYPES:
            for layout, layout_shapes in shapes.items():
                row = {"path": "forward_cuda", "in": _name(in_dtype), "out": _name(out_dtype),
                       "layout": layout, "cases": 0, "bitwise_equal_native": 0, "ok": True,
                       "max_abs_diff": 0.0}  # fmt: skip
                for shape in layout_shapes:
                    x = tn.random_pixels(shape, in_dtype, gen)
                    out = torch.full((shape[0] + 3, *shape[1:]), float("nan"), dtype=out_dtype,
                                     device="cuda")  # fmt: skip
                    y = norm_cuda.forward_cuda(x.cuda(), out_dtype, out=out, layout=layout).cpu()
                    want = norm.forward_native(x, out_dtype, layout=layout)
                    row["cases"] += 1
                    row["bitwise_equal_native"] += torch.equal(y, want)
                    diff = (y.double() - want.double()).abs().max().item()
                    row["max_abs_diff"] = max(row["max_abs_diff"], diff)
                    try:
                        ref = tn.reference_norm(x, *CLIP, layout)
                        tn.assert_matches_reference(y, ref, f"cuda {layout} {list(shape)}")
                    except AssertionError as exc:
                        row["ok"] = False
                        row["error"] = str(exc)[:200]
                    if not bool(out[shape[0] :].isnan().all()):
                        row["ok"] = False
                        row["error"] = "padding rows were written"
                rec["rows"].append(row)
    stage_vs_native(suite, rec, "cuda")
    rec["notes"].append("ok: within 1 ulp of float64 and padding rows untouched")


def h2d_bandwidth(suite: Suite, rec: dict[str, Any]) -> None:
    import torch

    sizes = [4, 64] if suite.quick else [1, 16, 64, 256]
    reps = 5 if suite.quick else 20
    stream = torch.cuda.Stream()
    for mb in sizes:
        n = mb << 20
        pageable = torch.randint(0, 256, (n,), dtype=torch.uint8)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(pageable)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")

        def copy(src: torch.Tensor, dst: torch.Tensor = dst) -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        pin_ms = wall_ms(lambda p=pinned: copy(p), reps, cuda=True)
        page_ms = wall_ms(lambda p=pageable: copy(p), reps, cuda=True)
        rec["rows"].append({"MiB": mb, "pinned_ms": pin_ms, "pageable_ms": page_ms,
                            "pinned_GBps": gbps(n, pin_ms), "pageable_GBps": gbps(n, page_ms),
                            "pinned_speedup": page_ms / pin_ms})  # fmt: skip
    rec["notes"].append("wall time per copy (synchronised), median; side stream, non_blocking")


def uint8_vs_bf16(suite: Suite, rec: dict[str, Any]) -> None:
    import anyio
    import torch

    from aiomm.device.stage import DeviceStage
    from aiomm.kernels import ChannelLayout, FusedMMInputNorm
    from aiomm.processing.processor import NormalizationParams

    norm = FusedMMInputNorm(*CLIP)
    norm_cuda = FusedMMInputNorm(*CLIP).cuda()
    reps = 5 if suite.quick else 20
    images = {
        "448x448 patches": ((1024, 1176), ChannelLayout.PATCHES),
        "1344x1344 patches": ((9216, 1176), ChannelLayout.PATCHES),
        "1344x1344 NCHW": ((1, 3, 1344, 1344), ChannelLayout.NCHW),
    }
    stage = DeviceStage("cuda", "bfloat16")
    classic_stage = DeviceStage("cuda", "bfloat16")
    for name, (shape, layout) in images.items():
        x = torch.randint(0, 256, shape, dtype=torch.uint8)
        x_pin = x.pin_memory()
        cpu_bf16 = norm.forward_native(x, torch.bfloat16, layout=layout)
        cpu_fp32 = norm.forward_native(x, torch.float32, layout=layout)
        bf16_pin = cpu_bf16.pin_memory()
        dev_u8 = torch.empty(shape, dtype=torch.uint8, device="cuda")
        dev_bf16 = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        h2d_u8 = event_ms(lambda a=dev_u8, b=x_pin: a.copy_(b, non_blocking=True), reps)
        h2d_bf16 = event_ms(lambda a=dev_bf16, b=bf16_pin: a.copy_(b, non_blocking=True), reps)
        fused = event_ms(
            lambda a=dev_u8, b=dev_bf16, lay=layout: norm_cuda.forward_cuda(a, torch.bfloat16,
                                                                        out=b, layout=lay),
            reps,
        )  # fmt: skip
        cpu_norm = wall_ms(lambda a=x, lay=layout: norm.forward_native(a, torch.bfloat16,
                                                                       layout=lay),
                           max(3, reps // 4), cuda=False)  # fmt: skip
        params = NormalizationParams(CLIP[0], CLIP[1], CLIP[2], layout)

        async def runs(a: torch.Tensor = x, b: torch.Tensor = cpu_fp32,
                       p: NormalizationParams = params) -> tuple[float, float]:  # fmt: skip
            for _ in range(2):
                await stage.run(a, p)
                await classic_stage.run(b, None)
            t_dev, t_classic = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                await stage.run(a, p)
                t_dev.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                await classic_stage.run(b, None)
                t_classic.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(t_dev), statistics.median(t_classic)

        stage_dev_ms, stage_classic_ms = anyio.run(runs)
        rec["rows"].append({
            "image": name,
            "uint8_MB": x.nbytes / 1e6,
            "bf16_MB": cpu_bf16.nbytes / 1e6,
            "h2d_uint8_ms": h2d_u8,
            "h2d_bf16_ms": h2d_bf16,
            "fused_kernel_ms": fused,
            "device_path_gpu_ms": h2d_u8 + fused,
            "classic_path_gpu_ms": h2d_bf16,
            "cpu_normalise_bf16_ms": cpu_norm,
            "stage_run_uint8_ms": stage_dev_ms,
            "stage_run_classic_ms": stage_classic_ms,
        })  # fmt: skip
    s = stage.statistics()
    rec["notes"].append(
        "device path: uint8 H2D + fused kernel on the GPU; classic path: bf16 H2D after the "
        "CPU normalise (cpu_normalise_bf16_ms, one thread-pool worker's time, not paid on the "
        "device path). stage_run_*: DeviceStage.run wall time, thread hops included."
    )
    rec["notes"].append(
        f"stage stats: copies={s.copies}, bytes={s.bytes_copied}, "
        f"copy_ms_last={s.copy_ms_last}, kernel_ms_last={s.kernel_ms_last}"
    )


def kernel_vs_copy(suite: Suite, rec: dict[str, Any]) -> None:
    import torch

    from aiomm.kernels import FusedMMInputNorm

    norm = FusedMMInputNorm(*CLIP).cuda()
    patches = (65536, 1176)
    cases = [((8, 3, 1344, 1344), "nchw", torch.bfloat16), (patches, "patches", torch.bfloat16),
             (patches, "patches", torch.float16), (patches, "patches", torch.float32)]  # fmt: skip
    if suite.quick:
        cases = [((2, 3, 1344, 1344), "nchw", torch.bfloat16),
                 ((16384, 1176), "patches", torch.bfloat16)]  # fmt: skip
    for shape, layout, dtype in cases:
        x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        out = torch.empty(shape, dtype=dtype, device="cuda")
        nbytes = x.nbytes + out.nbytes
        src = torch.randint(0, 256, (nbytes // 2,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        fused = bench_ms(lambda x=x, o=out, d=dtype, lay=layout: norm.forward_cuda(x, d, out=o,
                                                                                   layout=lay),
                         suite.quick)  # fmt: skip
        copy = bench_ms(lambda s=src, d=dst: d.copy_(s), suite.quick)
        rec["rows"].append({
            "shape": "x".join(map(str, shape)), "layout": layout, "out": _name(dtype),
            "MB_moved": nbytes / 1e6, "fused_ms": fused, "copy_ms": copy,
            "fused_GBps": gbps(nbytes, fused), "copy_GBps": gbps(nbytes, copy),
            "fused_vs_copy": copy / fused,
        })  # fmt: skip
    rec["notes"].append("bytes moved = uint8 read + output written; the copy moves as many bytes")


def device_stage_throughput(suite: Suite, rec: dict[str, Any]) -> None:
    import anyio
    import torch

    from aiomm.device.stage import DeviceStage
    from aiomm.kernels import ChannelLayout, FusedMMInputNorm
    from aiomm.processing.processor import NormalizationParams

    count = 32 if suite.quick else 128
    gen = torch.Generator().manual_seed(suite.seed + 3)
    rows_per_image = [int(n) for n in torch.randint(1024, 9217, (count,), generator=gen)]
    xs = [torch.randint(0, 256, (n, 1176), dtype=torch.uint8, generator=gen)
          for n in rows_per_image]  # fmt: skip
    total = sum(x.nbytes for x in xs)
    params = NormalizationParams(CLIP[0], CLIP[1], CLIP[2], ChannelLayout.PATCHES)
    naive_norm = FusedMMInputNorm(*CLIP).cuda()

    def naive(x: torch.Tensor) -> torch.Tensor:
        y = naive_norm(x.to("cuda"), torch.bfloat16, layout="patches")
        torch.cuda.current_stream().synchronize()
        return y

    async def drive(concurrency: int, fn: Callable[[torch.Tensor], Any]) -> float:
        limiter = anyio.Semaphore(concurrency)

        async def one(x: torch.Tensor) -> None:
            async with limiter:
                await fn(x)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for x in xs:
                tg.start_soon(one, x)
        return time.perf_counter() - t0

    for concurrency in (1, 2, 4, 8):
        stage = DeviceStage("cuda", "bfloat16", staging_buffers=min(concurrency, 4))

        async def staged(x: torch.Tensor, stage: DeviceStage = stage) -> None:
            await stage.run(x, params)

        async def unstaged(x: torch.Tensor) -> None:
            await anyio.to_thread.run_sync(naive, x)

        anyio.run(drive, concurrency, staged)  # warm-up: pool allocation, streams, kernel
        before = stage.statistics()
        seconds = anyio.run(drive, concurrency, staged)
        s = stage.statistics()
        anyio.run(drive, concurrency, unstaged)
        naive_s = anyio.run(drive, concurrency, unstaged)
        runs = s.runs - before.runs
        assert s.copy_ms_total is not None and before.copy_ms_total is not None
        assert s.kernel_ms_total is not None and before.kernel_ms_total is not None
        rec["rows"].append({
            "in_flight": concurrency,
            "images": count,
            "images_per_s": count / seconds,
            "GBps_uint8": total / seconds / 1e9,
            "copy_ms_mean": (s.copy_ms_total - before.copy_ms_total) / runs,
            "kernel_ms_mean": (s.kernel_ms_total - before.kernel_ms_total) / runs,
            "pool_peak": s.pool.peak_in_use if s.pool else None,
            "pool_MB": s.pool.total_bytes / 1e6 if s.pool else None,
            "naive_images_per_s": count / naive_s,
            "speedup_vs_naive": naive_s / seconds,
        })  # fmt: skip
    rec["notes"].append(
        "images: uint8 Qwen2-VL patch tensors of 1024-9216 rows (448^2 to 1344^2 pixels); "
        "naive: pageable .to('cuda') + kernel + stream sync in a worker thread"
    )


def engine_e2e(suite: Suite, rec: dict[str, Any]) -> None:
    import anyio
    import numpy as np
    import torch

    from aiomm.config import EngineConfig
    from aiomm.engine import Engine
    from aiomm.media.samples import encode, photo_like
    from aiomm.processing.processor import MultiModalConfig
    from aiomm.types import Request

    device = "cuda" if suite.cuda else "cpu"
    if suite.quick:
        count, sizes = (16, [(240, 320), (336, 448), (224, 224)])
    else:
        count, sizes = (96 if suite.cuda else 24, [(480, 640), (768, 1024), (1080, 1920),
                                                    (600, 400), (224, 224)])  # fmt: skip
    rng = np.random.default_rng(suite.seed)
    jpegs = [encode(photo_like(rng, *sizes[i % len(sizes)])) for i in range(count)]
    first: dict[bool, torch.Tensor] = {}

    async def measure(device_normalize: bool) -> dict[str, Any]:
        config = EngineConfig(
            device=device,
            cache_capacity_bytes=0,
            processing=MultiModalConfig(mm_device_do_normalize=device_normalize),
        )
        engine = Engine.from_pretrained("qwen2-vl", config)
        requests = [Request(prompt=PROMPT, images=[j], request_id=str(i))
                    for i, j in enumerate(jpegs)]  # fmt: skip
        async with engine:
            for r in requests[:2]:  # warm-up
                await engine.process(r)
            n = 0
            t0 = time.perf_counter()
            async with engine.stream(requests, raise_errors=True) as results:
                async for result in results:
                    pv = result.pixel_values
                    assert pv is not None and pv.device.type == device
                    if result.request_id == "0":
                        first[device_normalize] = pv.float().cpu()
                    n += 1
            seconds = time.perf_counter() - t0
            stats = engine.stats()
        return {
            "device": device,
            "mm_device_do_normalize": device_normalize,
            "images": n,
            "images_per_s": n / seconds,
            "bytes_to_device_MB": stats.bytes_to_device / 1e6,
            "device_stage_p50_ms": _p50_ms(stats.stages.get("device")),
            "transform_threads": config.transform_threads,
        }

    for flag in (True, False):
        rec["rows"].append(anyio.run(measure, flag))
    a, b = first[True], first[False]
    diff = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
    rec["notes"].append(
        f"pixel_values of request 0, device-normalise vs classic: shapes {list(a.shape)} / "
        f"{list(b.shape)}, max |diff| {diff:.3g} (any difference: bf16 rounding of two op orders)"
    )
    rec["rows"].append({"device": device, "mm_device_do_normalize": "ratio True/False",
                        "images_per_s": rec["rows"][0]["images_per_s"]
                        / rec["rows"][1]["images_per_s"]})  # fmt: skip


def resize_kernel(suite: Suite, rec: dict[str, Any]) -> None:
    """Device resize per image vs the CPU resize it reproduces, and bit-exactness against it."""
    import numpy as np
    import PIL.Image
    import torch
    import torch.nn.functional as F

    from aiomm.kernels import ResampleVariant, resize_uint8
    from aiomm.media.samples import photo_like

    device = "cuda" if suite.cuda else "cpu"
    cases = [((1080, 1920), (728, 1316)), ((3024, 4032), (1008, 1344)), ((480, 640), (476, 644))]
    if suite.quick:
        cases = cases[:1] if suite.cuda else [((120, 160), (84, 112))]
    rng = np.random.default_rng(suite.seed)

    def pil_resize(img: PIL.Image.Image, oh: int, ow: int) -> np.ndarray:
        return np.asarray(img.resize((ow, oh), PIL.Image.Resampling.BICUBIC))

    def torch_resize(chw: torch.Tensor, oh: int, ow: int) -> torch.Tensor:
        out = F.interpolate(chw, size=(oh, ow), mode="bicubic", antialias=True, align_corners=False)
        return out[0].permute(1, 2, 0)

    for (h, w), (oh, ow) in cases:
        img = photo_like(rng, h, w)
        hwc = np.asarray(img)
        src = torch.from_numpy(hwc.copy()).to(device)
        chw = torch.from_numpy(hwc.copy()).permute(2, 0, 1).contiguous().unsqueeze(0)
        cpu_fns = {
            ResampleVariant.PIL_BICUBIC: functools.partial(pil_resize, img, oh, ow),
            ResampleVariant.TORCH_BICUBIC_AA: functools.partial(torch_resize, chw, oh, ow),
        }
        for variant, cpu_fn in cpu_fns.items():
            expected = torch.as_tensor(np.asarray(cpu_fn()))
            got = resize_uint8(src, oh, ow, variant, layout="hwc").cpu()
            cpu_ms = wall_ms(cpu_fn, 3 if suite.quick else 10, cuda=False)
            run = functools.partial(resize_uint8, src, oh, ow, variant, layout="hwc")
            dev_ms = bench_ms(run, suite.quick) if suite.cuda else wall_ms(run, 3, cuda=False)
            rec["rows"].append(
                {
                    "variant": variant.value,
                    "source": f"{h}x{w}",
                    "target": f"{oh}x{ow}",
                    "device": device,
                    "cpu_resize_ms": cpu_ms,
                    "device_resize_ms": dev_ms,
                    "speedup": cpu_ms / dev_ms if dev_ms else None,
                    "ok": bool(torch.equal(got, expected)),
                }
            )


def engine_device_resize(suite: Suite, rec: dict[str, Any]) -> None:
    """Engine images/s with resize + patchify on the device vs on the CPU (same outputs)."""
    import anyio
    import numpy as np
    import torch

    from aiomm.config import EngineConfig
    from aiomm.engine import Engine
    from aiomm.media.samples import encode, photo_like
    from aiomm.types import Request

    device = "cuda" if suite.cuda else "cpu"
    count = 12 if suite.quick else 96
    sizes = [(480, 640), (1080, 1920), (1536, 2048), (768, 1024)]
    if suite.quick:  # generating the large JPEGs alone would take most of a quick run
        sizes = [(480, 640), (600, 800), (768, 1024), (360, 480)]
    rng = np.random.default_rng(suite.seed + 1)
    jpegs = [encode(photo_like(rng, *sizes[i % len(sizes)])) for i in range(count)]
    first: dict[bool, torch.Tensor] = {}

    async def measure(device_resize: bool) -> dict[str, Any]:
        config = EngineConfig(device=device, cache_capacity_bytes=0,
                              mm_device_resize=device_resize)  # fmt: skip
        engine = Engine.from_pretrained("qwen2-vl", config)
        requests = [Request(prompt=PROMPT, images=[j], request_id=str(i))
                    for i, j in enumerate(jpegs)]  # fmt: skip
        async with engine:
            await engine.process(requests[0])  # warm-up (kernel compilation)
            n = 0
            t0 = time.perf_counter()
            async with engine.stream(requests, raise_errors=True) as results:
                async for result in results:
                    if result.request_id == "0":
                        first[device_resize] = result.pixel_values.cpu()
                    n += 1
            seconds = time.perf_counter() - t0
        return {
            "device": device,
            "mm_device_resize": device_resize,
            "images": n,
            "images_per_s": n / seconds,
            "transform_threads": config.transform_threads,
        }

    for flag in (True, False):
        rec["rows"].append(anyio.run(measure, flag))
    equal = torch.equal(first[True], first[False])
    rec["rows"].append({"device": device, "mm_device_resize": "ratio True/False",
                        "images_per_s": rec["rows"][0]["images_per_s"]
                        / rec["rows"][1]["images_per_s"], "ok": equal})  # fmt: skip
    rec["notes"].append(f"pixel_values of request 0 equal bit for bit: {equal}")


def _p50_ms(latency: Any) -> float | None:
    return None if latency is None else latency.p50 * 1e3


def _name(dtype: Any, *, long: bool = False) -> str:
    text = str(dtype).removeprefix("torch.")
    if long:
        return text
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(text, text)


# ---------------------------------------------------------------------- main


def environment(how: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "aiomm": how,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count,
                   cuda_runtime=torch.version.cuda)  # fmt: skip
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("results_dir", type=Path, help="folder for results.md and results.json")
    parser.add_argument("--quick", action="store_true", help="small sizes and counts")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock")
    parser.add_argument(
        "--only",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=None,
        help=f"comma-separated sections to run (default: all): {', '.join(SECTIONS)}",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    how = ensure_aiomm()
    import torch

    seed = args.seed if args.seed is not None else time.time_ns() % 2**31
    suite = Suite(args.results_dir, quick=args.quick, seed=seed, cuda=torch.cuda.is_available(),
                  only=args.only)  # fmt: skip
    suite.environment = environment(how)
    print(f"aiomm gpu suite: cuda={suite.cuda} quick={suite.quick} seed={seed}", flush=True)
    if not suite.cuda:
        print(NO_GPU, flush=True)

    suite.run("native_correctness", "forward_native vs float64 reference",
              lambda rec: native_correctness(suite, rec))  # fmt: skip
    if suite.cuda:
        suite.run("cuda_correctness", "forward_cuda and DeviceStage('cuda') vs native",
                  lambda rec: cuda_correctness(suite, rec))  # fmt: skip
    else:
        suite.run("cpu_stage_correctness", "DeviceStage('cpu') vs forward_native",
                  lambda rec: stage_vs_native(suite, rec, "cpu"))  # fmt: skip
    for name, title, fn in (
        ("h2d_bandwidth", "pinned vs pageable host-to-device copies", h2d_bandwidth),
        ("uint8_vs_bf16", "bytes and time per image: uint8 + fused vs bf16", uint8_vs_bf16),
        ("kernel_vs_copy", "fused kernel GB/s vs device-to-device copy", kernel_vs_copy),
        ("device_stage_throughput", "DeviceStage images/s by requests in flight",
         device_stage_throughput),
    ):  # fmt: skip
        suite.run(name, title, lambda rec, fn=fn: fn(suite, rec), needs_cuda=True)
    suite.run("engine_e2e", "engine images/s: device normalise vs classic CPU normalise",
              lambda rec: engine_e2e(suite, rec))  # fmt: skip
    suite.run("resize_kernel", "device resize per image vs the CPU resize (bit-exact check)",
              lambda rec: resize_kernel(suite, rec))  # fmt: skip
    suite.run("engine_device_resize", "engine images/s: device resize vs CPU resize",
              lambda rec: engine_device_resize(suite, rec))  # fmt: skip
    suite.write()
    print((args.results_dir / "results.md").read_text(), flush=True)
    bad = [s["name"] for s in suite.sections if s["status"] in ("failed", "mismatch")]
    if bad:
        print(f"sections failed: {', '.join(bad)}", file=sys.stderr, flush=True)
    # the summary comes last, so the end of a captured log says how the run went
    print(suite.summary(), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
