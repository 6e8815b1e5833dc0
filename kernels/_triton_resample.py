"""The separable resample passes ``_resample_h_kernel`` / ``_resample_v_kernel`` and their launcher.

Each pass reads a uint8 image viewed as ``[planes, rows, row_length]`` (contiguous rows: ``W * C``
interleaved elements in HWC, ``W`` in CHW where every channel is its own plane) and writes
another uint8 image: ``(2**(p - 1) + sum(pixel * weight)) >> p`` clipped to 0..255, in int32,
with the host's fixed-point taps (``resample.resize_coefficients``). Integer sums do not depend
on their order, so the result equals the torch reference bit for bit.

One program computes a ``BLOCK_Y x BLOCK_X`` tile of output rows x row elements, looping over
the taps of the axis (up to the longest tap count of the axis, masked past each output's):

* horizontal: the taps belong to the columns, so bounds and weights are gathered once per tile
  and each tap gathers ``BLOCK_Y`` strided rows of pixels;
* vertical: the taps belong to the rows, and each tap reads ``BLOCK_Y`` contiguous row segments.

The rows of all planes form one range (row ``r`` of plane ``p`` is ``p * rows + r``), so a
tile may span planes and the grid is one-dimensional. The image between two passes is uint8,
restricted to the rows (horizontal first) or columns (vertical first) that the second pass
reads, as in Pillow. One image, or a batch of same-size images in the leading dimensions, per
launch: images of different sizes take one call each (a first version).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from aiomm.errors import KernelInputError

from ._resample_plan import (
    ImageLayout,
    ResampleVariant,
    check_image,
    input_span,
    pass_order,
    resize_coefficients,
)

__all__ = ("resample_uint8_triton",)

_INT32_MAX = 2**31 - 1


@triton.jit
def _resample_h_kernel(
    src_ptr,
    dst_ptr,
    bounds_ptr,
    weights_ptr,
    ksize,
    max_taps,
    half,
    precision,
    tap_offset,
    src_row0,
    n_rows,
    total_rows,
    out_len,
    n_col_blocks,
    src_plane_stride,
    src_row_stride,
    dst_plane_stride,
    dst_row_stride,
    C: tl.constexpr,
    BLOCK_Y: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    pid = tl.program_id(0)
    row_block = pid // n_col_blocks
    col_block = pid - row_block * n_col_blocks
    # Rows of all planes in one range: row `r` of plane `p` is `p * n_rows + r`.
    rows = row_block * BLOCK_Y + tl.arange(0, BLOCK_Y)
    row_mask = rows < total_rows
    plane = rows // n_rows
    r = rows - plane * n_rows
    idx = col_block * BLOCK_X + tl.arange(0, BLOCK_X)
    col_mask = idx < out_len
    xo = idx // C
    c = idx - xo * C
    # The taps depend on the output column only: one gather of bounds and weights per tile.
    start = tl.load(bounds_ptr + 2 * xo, mask=col_mask, other=0) - tap_offset
    count = tl.load(bounds_ptr + 2 * xo + 1, mask=col_mask, other=0)
    src_rows = (
        src_ptr
        + plane.to(tl.int64) * src_plane_stride
        + (r + src_row0).to(tl.int64) * src_row_stride
    )
    w_row = weights_ptr + xo * ksize
    acc = tl.zeros([BLOCK_Y, BLOCK_X], dtype=tl.int32) + half
    for k in range(0, max_taps):
        tap = col_mask & (k < count)
        w = tl.load(w_row + k, mask=tap, other=0)
        v = tl.load(
            src_rows[:, None] + ((start + k) * C + c)[None, :],
            mask=row_mask[:, None] & tap[None, :],
            other=0,
        )
        acc += v.to(tl.int32) * w[None, :]
    out = tl.minimum(tl.maximum(acc >> precision, 0), 255).to(tl.uint8)
    dst_rows = dst_ptr + plane.to(tl.int64) * dst_plane_stride + r.to(tl.int64) * dst_row_stride
    tl.store(dst_rows[:, None] + idx[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _resample_v_kernel(
    src_ptr,
    dst_ptr,
    bounds_ptr,
    weights_ptr,
    ksize,
    max_taps,
    half,
    precision,
    tap_offset,
    src_col0,
    n_rows,
    total_rows,
    out_len,
    n_col_blocks,
    src_plane_stride,
    src_row_stride,
    dst_plane_stride,
    dst_row_stride,
    BLOCK_Y: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    pid = tl.program_id(0)
    row_block = pid // n_col_blocks
    col_block = pid - row_block * n_col_blocks
    rows = row_block * BLOCK_Y + tl.arange(0, BLOCK_Y)
    row_mask = rows < total_rows
    plane = rows // n_rows
    yo = rows - plane * n_rows
    idx = col_block * BLOCK_X + tl.arange(0, BLOCK_X)
    col_mask = idx < out_len
    # The taps depend on the output row only; each tap reads contiguous input row segments.
    start = tl.load(bounds_ptr + 2 * yo, mask=row_mask, other=0) - tap_offset
    count = tl.load(bounds_ptr + 2 * yo + 1, mask=row_mask, other=0)
    src_planes = src_ptr + plane.to(tl.int64) * src_plane_stride + src_col0
    w_col = weights_ptr + yo * ksize
    acc = tl.zeros([BLOCK_Y, BLOCK_X], dtype=tl.int32) + half
    for k in range(0, max_taps):
        tap = row_mask & (k < count)
        w = tl.load(w_col + k, mask=tap, other=0)
        src_rows = src_planes + (start + k).to(tl.int64) * src_row_stride
        v = tl.load(
            src_rows[:, None] + idx[None, :],
            mask=tap[:, None] & col_mask[None, :],
            other=0,
        )
        acc += v.to(tl.int32) * w[:, None]
    out = tl.minimum(tl.maximum(acc >> precision, 0), 255).to(tl.uint8)
    dst_rows = dst_ptr + plane.to(tl.int64) * dst_plane_stride + yo.to(tl.int64) * dst_row_stride
    tl.store(dst_rows[:, None] + idx[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


_INTERPRETED = isinstance(_resample_h_kernel, InterpretedFunction)
# Elements per tile: ~16 per thread on a GPU; the interpreter runs programs one after another in
# Python, so there a tile covers a whole small image.
_MAX_TILE = 16384 if _INTERPRETED else 2048


def _planes(shape: torch.Size, layout: ImageLayout) -> int:
    """The number of ``[rows, row_length]`` planes the kernels see for an image of ``shape``."""
    n = 1
    for d in shape[:-3] if layout is ImageLayout.HWC else shape[:-2]:
        n *= d
    return n


@functools.lru_cache(maxsize=512)
def _device_coefficients(
    in_size: int, out_size: int, variant: ResampleVariant, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(bounds, weights, precision, max_taps)`` on ``device``."""
    bounds, weights, precision = resize_coefficients(in_size, out_size, variant)
    return bounds.to(device), weights.to(device), precision, int(bounds[:, 1].max())


def _tile(n_rows: int, out_len: int) -> tuple[int, int, int]:
    """``(BLOCK_Y, BLOCK_X, num_warps)``: rows of up to 512 elements, ``<= _MAX_TILE`` in all."""
    block_x = min(triton.next_power_of_2(out_len), 512, _MAX_TILE)
    block_y = max(1, min(triton.next_power_of_2(n_rows), _MAX_TILE // block_x))
    return block_y, block_x, 4 if block_x * block_y >= 1024 else 2


def _launch(
    kernel: Any,
    src: torch.Tensor,
    dst: torch.Tensor,
    coefficients: tuple[torch.Tensor, torch.Tensor, int, int],
    tap_offset: int,
    src_start: int,
    **constexprs: int,
) -> None:
    """One pass: ``dst`` is ``[P, rows, out_len]`` contiguous; ``src`` ``[P, H, L]`` contiguous."""
    bounds, weights, precision, max_taps = coefficients
    planes, n_rows, out_len = dst.shape
    block_y, block_x, num_warps = _tile(planes * n_rows, out_len)
    n_col_blocks = triton.cdiv(out_len, block_x)
    grid = (triton.cdiv(planes * n_rows, block_y) * n_col_blocks,)
    if grid[0] > _INT32_MAX:
        raise KernelInputError(f"{planes * n_rows} rows of {out_len} need {grid[0]} programs")
    kernel[grid](
        src,
        dst,
        bounds,
        weights,
        weights.shape[1],
        max_taps,
        1 << (precision - 1),
        precision,
        tap_offset,
        src_start,
        n_rows,
        planes * n_rows,
        out_len,
        n_col_blocks,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        BLOCK_Y=block_y,
        BLOCK_X=block_x,
        num_warps=num_warps,
        **constexprs,
    )


def _pass_h(
    src: torch.Tensor,
    rows: tuple[int, int],
    in_w: int,
    out_w: int,
    c: int,
    variant: ResampleVariant,
    tap_offset: int,
) -> torch.Tensor:
    """Horizontal pass over ``src`` rows ``[rows[0], rows[1])``; ``src`` is ``[P, H, W * c]``."""
    coefficients = _device_coefficients(in_w, out_w, variant, src.device)
    dst = torch.empty(
        (src.shape[0], rows[1] - rows[0], out_w * c), dtype=torch.uint8, device=src.device
    )
    _launch(_resample_h_kernel, src, dst, coefficients, tap_offset, rows[0], C=c)
    return dst


def _pass_v(
    src: torch.Tensor,
    cols: tuple[int, int],
    in_h: int,
    out_h: int,
    c: int,
    variant: ResampleVariant,
    tap_offset: int,
) -> torch.Tensor:
    """Vertical pass over ``src`` columns ``[cols[0], cols[1])``; ``src`` is ``[P, H, W * c]``."""
    coefficients = _device_coefficients(in_h, out_h, variant, src.device)
    dst = torch.empty(
        (src.shape[0], out_h, (cols[1] - cols[0]) * c), dtype=torch.uint8, device=src.device
    )
    _launch(_resample_v_kernel, src, dst, coefficients, tap_offset, cols[0] * c)
    return dst


def resample_uint8_triton(
    image: torch.Tensor,
    out_h: int,
    out_w: int,
    variant: ResampleVariant | str,
    *,
    layout: ImageLayout | str = ImageLayout.HWC,
) -> torch.Tensor:
    """Resize a uint8 image with the Triton passes, bit-exact to ``resize_uint8_reference``.

    Arguments and result are those of ``resize_uint8_reference``: ``image`` is uint8
    ``[..., H, W, C]`` (``"hwc"``) or ``[..., C, H, W]`` (``"chw"``); a non-contiguous image is
    copied to a contiguous one first. One launch per pass (at most two), one image or a batch of
    same-size images per call. CUDA tensors only, unless ``TRITON_INTERPRET=1`` was set before
    this module was imported.

    :raises UnsupportedDtypeError: ``image`` is not uint8.
    :raises LayoutError: unknown ``layout``, or ``image`` has fewer than 3 dimensions.
    :raises KernelInputError: wrong device, an empty image, an output size below 1, an unknown
        variant, or an image whose rows (of all planes) or row length reach 2**31.
    """
    if not image.is_cuda and not _INTERPRETED:
        raise KernelInputError(
            f"resample_uint8_triton needs a CUDA tensor, got one on {image.device}; use "
            "resize_uint8_reference, or set TRITON_INTERPRET=1 before importing "
            "aiomm.kernels to run the Triton kernels on the CPU"
        )
    variant = ResampleVariant.parse(variant)
    layout, in_h, in_w = check_image(image, out_h, out_w, layout)
    planes = _planes(image.shape, layout)
    c = image.shape[-1] if layout is ImageLayout.HWC else 1
    if planes * max(in_h, out_h) > _INT32_MAX or max(in_w, out_w) * c > _INT32_MAX:
        raise KernelInputError(
            f"image of shape {list(image.shape)} resized to {out_h}x{out_w} has 2**31 rows or "
            "row elements or more; use resize_uint8_reference"
        )
    lead = image.shape[:-3] if layout is ImageLayout.HWC else image.shape[:-2]
    out_shape = (*lead, out_h, out_w, c) if layout is ImageLayout.HWC else (*lead, out_h, out_w)
    x = image.contiguous().view(planes, in_h, in_w * c)
    order = pass_order(in_h, in_w, out_h, out_w, variant)
    if order == ("h", "v"):
        rows = input_span(in_h, out_h, variant)
        x = _pass_h(x, rows, in_w, out_w, c, variant, 0)
        x = _pass_v(x, (0, out_w), in_h, out_h, c, variant, rows[0])
    elif order == ("v", "h"):
        cols = input_span(in_w, out_w, variant)
        x = _pass_v(x, cols, in_h, out_h, c, variant, 0)
        x = _pass_h(x, (0, out_h), in_w, out_w, c, variant, cols[0])
    elif order == ("h",):
        x = _pass_h(x, (0, in_h), in_w, out_w, c, variant, 0)
    elif order == ("v",):
        x = _pass_v(x, (0, in_w), in_h, out_h, c, variant, 0)
    else:
        x = x.clone()
    return x.view(out_shape)
