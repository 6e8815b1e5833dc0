"""The float64 reference of the fused normalisation, shared by its tests and the benchmarks.

``tests/kernels/test_norm.py`` (through pytest's ``pythonpath``) and ``bench/gpu_suite.py`` /
``bench/kernel_bench.py`` (which put this folder on their own ``sys.path``) import this one copy,
so the tests and the benchmarks check the same numbers. Pure torch: no pytest, no aiomm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = (
    "FP32_MAX_ABS",
    "FP32_MAX_REL_NORM",
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "ULP_FORMAT",
    "assert_matches_reference",
    "random_pixels",
    "reference_norm",
    "ulp",
)

INPUT_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (mantissa bits, smallest normal exponent): one ulp of |v| in [2**e, 2**(e+1)) is 2**(e - bits).
ULP_FORMAT = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}
FP32_MAX_REL_NORM, FP32_MAX_ABS = 1e-6, 1e-5


def reference_norm(
    x: torch.Tensor,
    rescale_factor: float,
    image_mean: Sequence[float],
    image_std: Sequence[float],
    layout: str,
) -> torch.Tensor:
    """``(x * rescale_factor - mean[c]) / std[c]`` in float64, from ``x``'s values as given.

    The channel of flat element ``i`` is ``(i // stride) % C``, with the stride of ``layout``
    (``"nchw"``: ``H * W``; ``"nhwc"``: 1; ``"patches"``: ``row_length // C``).
    """
    c = len(image_mean)
    shape = x.shape
    stride = {"nchw": lambda: shape[-2] * shape[-1], "nhwc": lambda: 1}.get(
        layout.lower(), lambda: shape[-1] // c
    )()
    channel = (torch.arange(x.numel(), device=x.device) // max(stride, 1)) % c
    mean = torch.tensor(image_mean, dtype=torch.float64, device=x.device)[channel]
    std = torch.tensor(image_std, dtype=torch.float64, device=x.device)[channel]
    flat = x.reshape(-1).to(torch.float64)
    return ((flat * rescale_factor - mean) / std).reshape(shape)


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values at ``|ref|`` (the larger one at a power of two)."""
    bits, emin = ULP_FORMAT[dtype]
    _, e = torch.frexp(ref.abs())  # |ref| = m * 2**e, 0.5 <= m < 1
    e = torch.where(ref == 0, emin, torch.clamp(e - 1, min=emin))
    return torch.ldexp(torch.ones_like(ref), e - bits)


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32: norm-wise relative error and max abs error bounds; bf16/fp16: 1 ulp everywhere."""
    assert out.shape == ref.shape, f"{what}: shape {list(out.shape)} != {list(ref.shape)}"
    diff = (out.double() - ref).abs()
    if out.dtype == torch.float32:
        rel = (diff.norm() / ref.norm()).item()
        worst = diff.max().item()
        assert rel < FP32_MAX_REL_NORM and worst < FP32_MAX_ABS, (
            f"{what}: fp32 output rel err {rel:.3g} (< {FP32_MAX_REL_NORM}), "
            f"max abs err {worst:.3g} (< {FP32_MAX_ABS})"
        )
        return
    bad = diff > ulp(ref, out.dtype)
    if bad.any():
        i = int(torch.nonzero(bad.reshape(-1))[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {out.numel()} {out.dtype} elements are more than one "
            f"ulp from the reference; first at flat index {i}: out={out.reshape(-1)[i].item()!r} "
            f"ref={ref.reshape(-1)[i].item()!r} ulp={ulp(ref, out.dtype).reshape(-1)[i].item():.3g}"
        )


def random_pixels(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """uint8 over 0..255, floats uniform in [0, 255) rounded to ``dtype``; never all zeros."""
    if dtype == torch.uint8:
        x = torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=gen)
    else:
        x = (torch.rand(tuple(shape), dtype=torch.float64, generator=gen) * 255).to(dtype)
    x.reshape(-1)[0] = 200  # a one-element input is still not zero
    return x
