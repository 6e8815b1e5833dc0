"""Benchmark of the fused normalisation against torch eager and a device-to-device copy.

On CUDA, for each size: GB/s of ``FusedMMInputNorm.forward_cuda`` (bytes read + written), of
torch eager ``((x.float() * r - mean) / std).to(dtype)`` counted over the same logical bytes, and
of a plain copy of a uint8 buffer of ``(x.nbytes + out.nbytes) / 2`` bytes (so it also reads and
writes ``x.nbytes + out.nbytes``), as ``triton.testing.do_bench`` medians in one run; then the
host-to-device time of one image from pinned memory, as uint8 and as bf16. Targets on an H200:
fused >= 85% of the copy bandwidth and >= 5x eager.

On a CPU-only machine it times ``forward_native`` against eager on smaller sizes (perf_counter
medians) and says that the GPU figures need a CUDA device. The float64 reference comes from
``tests/kernels/test_norm.py``, so the test and the bench check the same numbers::

    python bench/kernel_bench.py [--sizes 8x3x1344x1344,65536x1176:patches] [--dtype bf16]
                                 [--json results/kernel_bench.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from aiomm.kernels import ChannelLayout, FusedMMInputNorm

REPO = Path(__file__).resolve().parents[1]
GPU_SIZES = "8x3x1344x1344,65536x1176:patches"
CPU_SIZES = "2x3x448x448,4096x1176:patches"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TARGET_COPY_RATIO, TARGET_EAGER_SPEEDUP = 0.85, 5.0
CLIP = (1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


def load_test_module() -> ModuleType:
    """``tests/kernels/test_norm.py`` by path (tests/ is not a package)."""
    path = REPO / "tests" / "kernels" / "test_norm.py"
    spec = importlib.util.spec_from_file_location("aiomm_bench_test_norm", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def check(out: torch.Tensor, x: torch.Tensor, layout: ChannelLayout, tn: ModuleType) -> str:
    """Compare with the float64 reference of the test file; returns 'ok' or raises."""
    r, mean, std = CLIP
    ref = tn.reference_norm(x, r, mean, std, layout.value)
    tn.assert_matches_reference(out, ref, f"bench {list(x.shape)} {layout.name}")
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


def cpu_row(norm: FusedMMInputNorm, shape, layout, dtype: torch.dtype, tn: ModuleType) -> dict:
    x = torch.randint(0, 256, shape, dtype=torch.uint8)
    out = torch.empty(shape, dtype=dtype)
    nbytes = x.nbytes + out.nbytes
    native_ms = cpu_median_ms(lambda: norm.forward_native(x, dtype, out=out, layout=layout))
    eager_ms = cpu_median_ms(eager_fn(x, layout, dtype))
    return {
        "shape": "x".join(map(str, shape)),
        "layout": layout.name,
        "check": check(out, x, layout, tn),
        "native_ms": native_ms,
        "eager_ms": eager_ms,
        "native_gbps": gbps(nbytes, native_ms),
        "eager_gbps": gbps(nbytes, eager_ms),
        "native_vs_eager": eager_ms / native_ms,
    }


def cuda_row(norm: FusedMMInputNorm, shape, layout, dtype: torch.dtype, tn: ModuleType) -> dict:
    from triton.testing import do_bench

    def bench(fn: Callable[[], object]) -> float:
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))

    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    out = torch.empty(shape, dtype=dtype, device="cuda")
    nbytes = x.nbytes + out.nbytes
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fused_ms = bench(lambda: norm.forward_cuda(x, dtype, out=out, layout=layout))
    ok = check(out, x, layout, tn)
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
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="visual dtype")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    tn = load_test_module()
    on_cuda = torch.cuda.is_available()
    sizes = parse_sizes(args.sizes or (GPU_SIZES if on_cuda else CPU_SIZES))
    print(f"fused input normalisation, uint8 -> {args.dtype}")
    norm = FusedMMInputNorm(*CLIP)
    if on_cuda:
        print(f"device: {torch.cuda.get_device_name()}")
        norm = norm.cuda()
    else:
        print("no CUDA device: timing forward_native against eager on the CPU")
    row = cuda_row if on_cuda else cpu_row
    rows = [row(norm, shape, layout, dtype, tn) for shape, layout in sizes]
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
