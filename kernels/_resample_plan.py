"""Host side of the bit-exact uint8 resize: variants, layouts, fixed-point taps and pass order.

Shared by the pure-torch reference (``resample.py``) and the Triton passes
(``_triton_resample.py``), which both import from here and never from each other upwards. What
decides exactness is computed here: the coefficients (the float64 operations in the same order as
the C code, see ``resample.py``) and the order of the passes (:func:`pass_order`).
"""

from __future__ import annotations

import enum
import functools
import importlib.metadata
import math
from typing import NamedTuple

import torch

from aiomm.errors import KernelInputError, LayoutError, UnsupportedDtypeError

from ._enums import parse_member

__all__ = (
    "ImageLayout",
    "ResampleVariant",
    "ResizeCoefficients",
    "check_image",
    "input_span",
    "pass_order",
    "resize_coefficients",
)

_PIL_PRECISION = 22
_TORCH_MAX_PRECISION = 22
# Pillow 13 (python-pillow/Pillow#9549) resamples vertically first when the height loses more
# than twice as many pixels as the width; earlier releases always go horizontal first.
_PIL_VERTICAL_FIRST_SINCE = (13,)


class ResampleVariant(enum.Enum):
    """Which library's integer bicubic resize is reproduced bit for bit."""

    #: ``PIL.Image.resize(..., Image.BICUBIC)`` of the installed Pillow (HF's PIL backend).
    PIL_BICUBIC = "pil_bicubic"
    #: ``torch.nn.functional.interpolate(uint8, "bicubic", antialias=True)`` on the CPU (HF's
    #: torchvision backend, via ``torchvision.transforms.v2.functional.resize``).
    TORCH_BICUBIC_AA = "torch_bicubic_aa"

    @classmethod
    def parse(cls, variant: ResampleVariant | str) -> ResampleVariant:
        """Return ``variant`` as a member; strings are matched case-insensitively.

        :raises KernelInputError: for an unknown name or a value of another type.
        """
        return parse_member(cls, variant, KernelInputError, "resample variant")


class ImageLayout(enum.Enum):
    """Where the channel axis of a uint8 image sits: ``[..., H, W, C]`` or ``[..., C, H, W]``."""

    HWC = "hwc"
    CHW = "chw"

    @classmethod
    def parse(cls, layout: ImageLayout | str) -> ImageLayout:
        """Return ``layout`` as a member; strings are matched case-insensitively.

        :raises LayoutError: for an unknown name or a value of another type.
        """
        return parse_member(cls, layout, LayoutError, "image layout")

    @property
    def spatial_dims(self) -> tuple[int, int]:
        """The (height, width) dimensions, counted from the end."""
        return (-3, -2) if self is ImageLayout.HWC else (-2, -1)


class ResizeCoefficients(NamedTuple):
    """The integer taps of one axis: output ``i`` is ``sum(in[bounds[i, 0] + k] * weights[i, k])``
    over ``k < bounds[i, 1]``, plus ``1 << (precision - 1)``, shifted right by ``precision`` and
    clipped to 0..255. ``weights`` is zero beyond ``bounds[i, 1]``. Both tensors are int32 on the
    CPU and shared by every caller of the cache: do not modify them.
    """

    bounds: torch.Tensor  # [out, 2]: first input index, number of taps
    weights: torch.Tensor  # [out, ksize], fixed point
    precision: int


def _pil_cubic(x: torch.Tensor) -> torch.Tensor:
    # Resample.c bicubic_filter, a = -0.5, operation by operation.
    a = -0.5
    x = x.abs()
    inner = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    outer = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1.0, inner, torch.where(x < 2.0, outer, torch.zeros_like(x)))


def _torch_cubic(x: torch.Tensor) -> torch.Tensor:
    # UpSampleKernel.cpp HelperInterpCubic::aa_filter<double, true> with UpSample.h's
    # cubic_convolution1/2 and A = -0.5.
    a = -0.5
    x = x.abs()
    inner = ((a + 2) * x - (a + 3)) * x * x + 1
    outer = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1.0, inner, torch.where(x < 2.0, outer, torch.zeros_like(x)))


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    # C's `(int)(v < 0 ? -0.5 + v : 0.5 + v)`: the float64 addition rounds first, then truncates.
    return torch.where(v < 0, v - 0.5, v + 0.5).trunc()


def _float_coefficients(
    in_size: int, out_size: int, variant: ResampleVariant
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xmin, n, weights, normalised)``: the float64 taps, each operation in the C code's order.

    ``weights`` is ``[out, ksize]``, divided by its row sum where that sum is not zero
    (``normalised``).
    """
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = math.ceil(support) * 2 + 1
    inv = 1.0 / filterscale
    i = torch.arange(out_size, dtype=torch.float64)
    center = (i + 0.5) * scale
    xmin = (center - support + 0.5).trunc().clamp(min=0).to(torch.int64)
    xmax = (center + support + 0.5).trunc().to(torch.int64).clamp(max=in_size)
    n = (xmax - xmin).clamp(0, ksize)
    j = torch.arange(ksize, dtype=torch.int64)
    taps = (xmin[:, None] + j[None, :]).to(torch.float64)
    arg = ((taps - center[:, None]) + 0.5) * inv
    fn = _pil_cubic if variant is ResampleVariant.PIL_BICUBIC else _torch_cubic
    w = torch.where(j[None, :] < n[:, None], fn(arg), torch.zeros((), dtype=torch.float64))
    total = torch.zeros(out_size, dtype=torch.float64)
    for k in range(ksize):  # sequential, as in C (a float64 sum depends on its order)
        total = total + w[:, k]
    nonzero = total != 0.0
    w = torch.where(nonzero[:, None], w / torch.where(nonzero, total, 1.0)[:, None], w)
    return xmin, n, w, nonzero


def _check_sizes(in_size: int, out_size: int) -> None:
    for name, v in (("in_size", in_size), ("out_size", out_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise KernelInputError(f"{name} must be a positive int, got {v!r}")
    if max(in_size, out_size) >= 2**24:
        raise KernelInputError(f"sizes must be < 2**24, got {in_size} -> {out_size}")


@functools.lru_cache(maxsize=1024)
def _coefficients(in_size: int, out_size: int, variant: ResampleVariant) -> ResizeCoefficients:
    xmin, n, w, nonzero = _float_coefficients(in_size, out_size, variant)
    if variant is ResampleVariant.PIL_BICUBIC:
        precision = _PIL_PRECISION
    else:
        wt_max = float(w[nonzero].max()) if bool(nonzero.any()) else 0.0
        precision = 0
        while precision < _TORCH_MAX_PRECISION:
            if int(0.5 + wt_max * (1 << (precision + 1))) >= 1 << 15:
                break
            precision += 1
    fixed = _round_half_away(w * float(1 << precision)).to(torch.int32)
    bounds = torch.stack([xmin, n], dim=1).to(torch.int32)
    return ResizeCoefficients(bounds.contiguous(), fixed.contiguous(), precision)


def resize_coefficients(
    in_size: int, out_size: int, variant: ResampleVariant | str
) -> ResizeCoefficients:
    """The fixed-point taps of one axis resized from ``in_size`` to ``out_size`` (cached).

    Returns ``(bounds, weights, precision)``: int32 ``[out_size, 2]`` (first input index, tap
    count), int32 ``[out_size, ksize]`` and the number of fractional bits, as
    :class:`ResizeCoefficients`. The tensors live on the CPU and are shared: do not modify them.

    :raises KernelInputError: a size below 1 or at least ``2**24``, or an unknown variant.
    """
    _check_sizes(in_size, out_size)
    return _coefficients(in_size, out_size, ResampleVariant.parse(variant))


@functools.lru_cache(maxsize=1024)
def input_span(in_size: int, out_size: int, variant: ResampleVariant) -> tuple[int, int]:
    """``(first, last)``: the input indices ``[first, last)`` that any tap of the axis reads."""
    bounds = _coefficients(in_size, out_size, variant).bounds
    return int(bounds[:, 0].min()), int((bounds[:, 0] + bounds[:, 1]).max())


@functools.cache
def _pillow_version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("pillow")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - pillow is a dependency
        return _PIL_VERTICAL_FIRST_SINCE
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def pass_order(
    in_h: int,
    in_w: int,
    out_h: int,
    out_w: int,
    variant: ResampleVariant | str,
    *,
    pillow_version: tuple[int, ...] | None = None,
) -> tuple[str, ...]:
    """The passes the reproduced library runs, in order: a tuple of ``"h"`` and ``"v"``.

    An axis whose size does not change gets no pass. When both change, torch always runs the
    horizontal pass first. Pillow 13 and later run the vertical pass first when the height
    shrinks and loses more than twice as many pixels as the width
    (``in_h > out_h and in_h - out_h > 2 * (in_w - out_w)``, in pixels, not ratios; found
    against Pillow 13.0.0 and tested on the pass-order boundary); earlier releases always go
    horizontal first. ``pillow_version`` defaults to the installed Pillow's version.

    :raises KernelInputError: an unknown variant.
    """
    variant = ResampleVariant.parse(variant)
    need_h, need_v = in_w != out_w, in_h != out_h
    if not (need_h and need_v):
        return ("h",) * need_h + ("v",) * need_v
    if variant is ResampleVariant.PIL_BICUBIC:
        version = _pillow_version() if pillow_version is None else tuple(pillow_version)
        if version >= _PIL_VERTICAL_FIRST_SINCE and in_h - out_h > max(2 * (in_w - out_w), 0):
            return ("v", "h")
    return ("h", "v")


def check_image(
    image: torch.Tensor, out_h: int, out_w: int, layout: ImageLayout | str
) -> tuple[ImageLayout, int, int]:
    """Validate one call of either path; returns the layout and the input ``(height, width)``.

    :raises UnsupportedDtypeError: ``image`` is not uint8.
    :raises LayoutError: unknown ``layout``, or ``image`` has fewer than 3 dimensions.
    :raises KernelInputError: an empty image, or an output size below 1 or at least ``2**24``.
    """
    layout = ImageLayout.parse(layout)
    if image.dtype != torch.uint8:
        raise UnsupportedDtypeError(f"image dtype {image.dtype} is not supported; expected uint8")
    if image.dim() < 3:
        need = "[..., H, W, C]" if layout is ImageLayout.HWC else "[..., C, H, W]"
        raise LayoutError(
            f"image of shape {list(image.shape)} does not fit layout {layout.name}: "
            f"expected {need} (ndim >= 3)"
        )
    if image.numel() == 0:
        raise KernelInputError(f"image of shape {list(image.shape)} is empty")
    dh, dw = layout.spatial_dims
    in_h, in_w = image.shape[dh], image.shape[dw]
    for name, v in (("out_h", out_h), ("out_w", out_w)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v >= 2**24:
            raise KernelInputError(f"{name} must be an int in [1, 2**24), got {v!r}")
    return layout, in_h, in_w
