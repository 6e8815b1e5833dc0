"""Benchmark of the fused normalisation against torch eager and a device-to-device copy.

On CUDA, for each size: GB/s of ``FusedMMInputNorm.forward_cuda`` (bytes read + written), of
torch eager ``((x.float() * r - mean) / std).to(dtype)`` counted over the same logical bytes, and
of a plain copy of a uint8 buffer of ``(x.nbytes + out.nbytes) / 2`` bytes (so it also reads and
writes ``x.nbytes + out.nbytes``), as ``triton.testing.do_bench`` medians in one run; then the
host-to-device time of one image from pinned memory, as uint8 and as bf16. Targets on an H200:
fused >= 85% of the copy bandwidth and >= 5x eager.

On a CPU-only machine it times ``forward_native`` and the table path that a CPU engine runs
(``forward_table``) against eager on smaller sizes (perf_counter medians) and says that the GPU
figures need a CUDA device. Every output is checked against the float64 reference of
``tests/support/norm_reference.py``, the one copy the tests import, so the tests and the bench
check the same numbers; a failed check makes the exit status 1. ``--quick`` runs small sizes (a
smoke test, a few seconds)::

    python bench/kernel_bench.py [--quick] [--sizes 8x3x1344x1344,65536x1176:patches]
                                 [--dtype bf16] [--json results/kernel_bench.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch
from _support import load_reference

from aiomm.kernels import ChannelLayout, FusedMMInputNorm

GPU_SIZES = "8x3x1344x1344,65536x1176:patches"
CPU_SIZES = "2x3x448x448,4096x1176:patches"
QUICK_SIZES = "1x3x64x96,64x1176:patches"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TARGET_COPY_RATIO, TARGET_EAGER_SPEEDUP = 0.85, 5.0
CLIP = (1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


def parse_sizes(text: str) -> list[tuple[tuple[int, ...], ChannelLayout]]:
    """``"8x3x1344x1344,65536x1176:patches"`` -> shapes with layouts (4-D: NCHW, 2-D: PATCHES)."""
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        dims, _, layout = item.partition(":")
        shape = tuple(int(d) for d in dims.lower().split("x"))
        default = ChannelLayout.PATCHES if len(shape) == 2 else ChannelLayout.NCHW
        sizes.append((shape, ChannelLayout.parse(layout) if layout else default))
    return sizes


def eager_fn(
    x: torch.Tensor, layout: ChannelLayout, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """What a processor does without the kernel: fp32 temporaries, three passes, then a cast."""
    r, mean, std = CLIP
    view = {ChannelLayout.NCHW: (3, 1, 1), ChannelLayout.NHWC: (3,)}.get(layout, (3, 1))
    m = torch.tensor(mean, device=x.device).view(view)
    s = torch.tensor(std, device=x.device).view(view)
    xv = x.unflatten(-1, (3, -1)) if layout is ChannelLayout.PATCHES else x
    return lambda: ((xv.float() * r - m) / s).to(dtype)


def check(out: torch.Tensor, x: torch.Tensor, layout: ChannelLayout, ref: ModuleType) -> str:
    """``"ok"``, or ``"FAILED: ..."`` when ``out`` is off the float64 reference."""
    r, mean, std = CLIP
    want = ref.reference_norm(x.cpu(), r, mean, std, layout.value)
    try:
        ref.assert_matches_reference(out.cpu(), want, f"bench {list(x.shape)} {layout.name}")
    except AssertionError as exc:
        return f"FAILED: {str(exc)[:200]}"
    return "ok"


def cpu_median_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def cpu_row(norm: FusedMMInputNorm, shape, layout, dtype: torch.dtype, ref: ModuleType) -> dict:
    x = torch.randint(0, 256, shape, dtype=torch.uint8)
    out = torch.empty(shape, dtype=dtype)
    table_out = torch.empty(shape, dtype=dtype)
    nbytes = x.nbytes + out.nbytes
    native_ms = cpu_median_ms(lambda: norm.forward_native(x, dtype, out=out, layout=layout))
    table_ms = cpu_median_ms(lambda: norm.forward_table(x, dtype, out=table_out, layout=layout))
    eager_ms = cpu_median_ms(eager_fn(x, layout, dtype))
    ok = check(out, x, layout, ref)
    if ok == "ok" and not torch.equal(table_out, out):
        ok = "FAILED: forward_table differs from forward_native"
    return {
        "shape": "x".join(map(str, shape)),
        "layout": layout.name,
        "check": ok,
        "native_ms": native_ms,
        "table_ms": table_ms,
        "eager_ms": eager_ms,
        "native_gbps": gbps(nbytes, native_ms),
        "table_gbps": gbps(nbytes, table_ms),
        "eager_gbps": gbps(nbytes, eager_ms),
        "native_vs_eager": eager_ms / native_ms,
        "table_vs_eager": eager_ms / table_ms,
    }


def cuda_row(
    norm: FusedMMInputNorm, shape, layout, dtype: torch.dtype, ref: ModuleType, *, quick: bool
) -> dict:
    from triton.testing import do_bench

    def bench(fn: Callable[[], object]) -> float:
        return float(do_bench(fn, warmup=10 if quick else 25, rep=50 if quick else 200,
                              return_mode="median"))  # fmt: skip

    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    out = torch.empty(shape, dtype=dtype, device="cuda")
    nbytes = x.nbytes + out.nbytes
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fused_ms = bench(lambda: norm.forward_cuda(x, dtype, out=out, layout=layout))
    ok = check(out, x, layout, ref)
    eager_ms = bench(eager_fn(x, layout, dtype))
    copy_ms = bench(lambda: dst.copy_(src))
    # One image (a dim-0 slice) from pinned host memory, as uint8 and as bf16.
    img = x[0].cpu().pin_memory()
    img_bf16 = img.to(torch.bfloat16).pin_memory()
    dev_u8, dev_bf16 = torch.empty_like(img, device="cuda"), img_bf16.to("cuda")
    h2d_u8 = bench(lambda: dev_u8.copy_(img, non_blocking=True))
    h2d_bf16 = bench(lambda: dev_bf16.copy_(img_bf16, non_blocking=True))
    return {
        "shape": "x".join(map(str, shape)),
        "layout": layout.name,
        "check": ok,
        "fused_ms": fused_ms,
        "eager_ms": eager_ms,
        "copy_ms": copy_ms,
        "fused_gbps": gbps(nbytes, fused_ms),
        "eager_gbps": gbps(nbytes, eager_ms),
        "copy_gbps": gbps(nbytes, copy_ms),
        "fused_vs_copy": copy_ms / fused_ms,
        "fused_vs_eager": eager_ms / fused_ms,
        "h2d_image_uint8_ms": h2d_u8,
        "h2d_image_bf16_ms": h2d_bf16,
    }


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help=f"default: {GPU_SIZES} on CUDA, {CPU_SIZES} on the CPU")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, fewer reps")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="visual dtype")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    ref = load_reference()
    on_cuda = torch.cuda.is_available()
    default = QUICK_SIZES if args.quick else GPU_SIZES if on_cuda else CPU_SIZES
    sizes = parse_sizes(args.sizes or default)
    print(f"fused input normalisation, uint8 -> {args.dtype}")
    norm = FusedMMInputNorm(*CLIP)
    if on_cuda:
        print(f"device: {torch.cuda.get_device_name()}")
        norm = norm.cuda()
        rows = [cuda_row(norm, shape, layout, dtype, ref, quick=args.quick)
                for shape, layout in sizes]  # fmt: skip
    else:
        print("no CUDA device: timing forward_native and forward_table against eager on the CPU")
        rows = [cpu_row(norm, shape, layout, dtype, ref) for shape, layout in sizes]
    print(markdown(rows))
    if on_cuda:
        for row in rows:
            hit = (
                row["fused_vs_copy"] >= TARGET_COPY_RATIO
                and row["fused_vs_eager"] >= TARGET_EAGER_SPEEDUP
            )
            print(
                f"{row['shape']}: fused = {row['fused_vs_copy']:.0%} of copy bandwidth, "
                f"{row['fused_vs_eager']:.1f}x eager; targets (>= {TARGET_COPY_RATIO:.0%}, "
                f">= {TARGET_EAGER_SPEEDUP:.0f}x): {'met' if hit else 'NOT met'}"
            )
    else:
        print("GPU figures need a CUDA device (fused kernel, copy bandwidth, pinned H2D).")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"device": "cuda" if on_cuda else "cpu", "dtype": args.dtype, "rows": rows}
        args.json.write_text(json.dumps(report, indent=2))
    failed = [row["shape"] for row in rows if row["check"] != "ok"]
    if failed:
        print(f"checks failed against the float64 reference: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
