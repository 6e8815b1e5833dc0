"""The fused normalisation kernel ``_fused_norm_kernel`` and its launcher.

One program normalises ``BLOCK`` consecutive elements of the flat input: a streaming load
(uint8/fp16/bf16/fp32), fp32 arithmetic in registers, a store in the output dtype. No global fp32
intermediate exists. The channel of an element is ``(flat // channel_stride) % C``; the kernel
never divides per element by a runtime value:

* stride 1 (NHWC): ``c = flat % C`` with ``C`` a compile-time constant;
* stride >= BLOCK (NCHW images): a block spans at most two channels, so one scalar division per
  program and a compare per element suffice;
* otherwise (patch rows, tiny images): ``flat // stride`` inside the block is a multiply-high by a
  host-computed magic number, exact for block-local indices.

Per-element indices are int32 (int64 division is about twice as slow); only programs of tensors
with >= 2**31 elements compute their base offset in int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from aiomm.errors import KernelInputError

from ._norm_checks import MAX_KERNEL_CHANNELS, ChannelLayout, check_call

__all__ = ("fused_mm_input_norm_triton",)

_INT32_MAX = 2**31 - 1
_GRID_X_MAX = 2**31 - 1


@triton.jit
def _channel_value(ptr, c, NUM_CHANNELS: tl.constexpr):
    # An unrolled select over the C scalars: ALU work instead of a gather per element.
    v = tl.zeros(c.shape, tl.float32) + tl.load(ptr)
    for i in tl.static_range(1, NUM_CHANNELS):
        v = tl.where(c == i, tl.load(ptr + i), v)
    return v


@triton.jit
def _round_to_bf16(y):
    """fp32 -> bf16, round to nearest even, in integer arithmetic.

    The Triton interpreter casts fp32 to bf16 by truncation, while GPUs round to nearest even;
    rounding explicitly gives the same bits on both, so the interpreted CI tests check the
    rounding the GPU runs. Four integer ops a value, free in this memory-bound kernel.
    """
    bits = y.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fused_norm_kernel(
    x_ptr,
    out_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    n_elements,
    channel_stride,
    stride_magic,
    NUM_CHANNELS: tl.constexpr,
    STRIDE_MODE: tl.constexpr,  # 0: stride 1; 1: stride < BLOCK (magic); 2: stride >= BLOCK
    HAS_SHIFT: tl.constexpr,
    INT64: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    idx = tl.arange(0, BLOCK)
    offs = start + idx
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0, eviction_policy="evict_first").to(tl.float32)

    if STRIDE_MODE == 2:
        q0 = start // channel_stride
        # Index in the block where the next channel starts (BLOCK: none in this block).
        boundary = tl.minimum((q0 + 1) * channel_stride - start, BLOCK).to(tl.int32)
        c0 = (q0 % NUM_CHANNELS).to(tl.int32)
        c1 = (c0 + 1) % NUM_CHANNELS
        second = idx >= boundary
        w = tl.where(second, tl.load(w_ptr + c1), tl.load(w_ptr + c0))
        if HAS_SHIFT:
            s_hi = tl.where(second, tl.load(s_ptr + c1), tl.load(s_ptr + c0))
            s_lo = tl.where(
                second, tl.load(s_ptr + NUM_CHANNELS + c1), tl.load(s_ptr + NUM_CHANNELS + c0)
            )
        else:
            b = tl.where(second, tl.load(b_ptr + c1), tl.load(b_ptr + c0))
    else:
        if STRIDE_MODE == 0:
            c = ((start % NUM_CHANNELS).to(tl.int32) + idx) % NUM_CHANNELS
        else:
            q0 = start // channel_stride
            r0 = (start - q0 * channel_stride).to(tl.int32)
            # (r0 + idx) // stride, exact for r0 + idx < 2 * BLOCK (see _stride_magic).
            q = tl.umulhi((r0 + idx) * 2, stride_magic)
            c = ((q0 % NUM_CHANNELS).to(tl.int32) + q) % NUM_CHANNELS
        w = _channel_value(w_ptr, c, NUM_CHANNELS)
        if HAS_SHIFT:
            s_hi = _channel_value(s_ptr, c, NUM_CHANNELS)
            s_lo = _channel_value(s_ptr + NUM_CHANNELS, c, NUM_CHANNELS)
        else:
            b = _channel_value(b_ptr, c, NUM_CHANNELS)

    if HAS_SHIFT:
        # x - s_hi is exact near zero (Sterbenz), so small outputs keep full relative precision.
        y = ((x - s_hi) - s_lo) * w
    else:
        y = tl.fma(x, w, b)
    if OUT_BF16:
        tl.store(out_ptr + offs, _round_to_bf16(y), mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_elements: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: 16 elements a thread on large tensors (128-bit uint8 loads)."""
    if n_elements >= 1 << 20:
        return 4096, 8
    return 1024, 4


def _stride_magic(channel_stride: int) -> int:
    """``M`` with ``umulhi(2 * i, M) == i // channel_stride`` while ``i * channel_stride < 2**31``.

    ``M = ceil(2**31 / d)``, so ``2*i*M / 2**32 = i/d + e`` with ``0 <= e < i / 2**31``; the floor
    is exact while ``e < 1/d``. The kernel uses it for ``2 <= d < BLOCK`` and ``i < 2 * BLOCK``, far
    inside that bound, and ``M <= 2**30`` fits an int32.
    """
    return -(-(1 << 31) // channel_stride)


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shift: torch.Tensor | None,
    channel_stride: int,
    *,
    block: int,
    num_warps: int,
    int64: bool,
) -> None:
    """Launch on contiguous, validated tensors; writes ``out``'s first ``x.numel()`` elements."""
    n = x.numel()
    if channel_stride == 1:
        mode, magic = 0, 0
    elif channel_stride >= block:
        mode, magic = 2, 0
    else:
        mode, magic = 1, _stride_magic(channel_stride)
    grid = (triton.cdiv(n, block),)
    if grid[0] > _GRID_X_MAX:
        raise KernelInputError(f"{n} elements need {grid[0]} programs, over the grid limit")
    _fused_norm_kernel[grid](
        x,
        out,
        weight,
        bias,
        bias if shift is None else shift,
        n,
        channel_stride,
        magic,
        NUM_CHANNELS=weight.numel(),
        STRIDE_MODE=mode,
        HAS_SHIFT=shift is not None,
        INT64=int64,
        OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK=block,
        num_warps=num_warps,
    )


def fused_mm_input_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    visual_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    layout: ChannelLayout | str = ChannelLayout.NCHW,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x * weight[c] + bias[c]`` in fp32, written as ``visual_dtype``, in one kernel launch.

    ``x``: uint8, float16, bfloat16 or float32 in ``layout`` (``"nchw"``, ``"nhwc"``,
    ``"patches"``); a non-contiguous ``x`` is copied to a contiguous one first. ``weight`` and
    ``bias``: float32 ``[C]`` on ``x``'s device, ``C <= 16``. ``shift``: optional float32 ``[2, C]``
    whose rows sum to ``-bias / weight`` beyond fp32 precision (``FusedMMInputNorm`` passes it);
    the kernel then computes ``((x - shift[0]) - shift[1]) * weight``, which is within one rounding
    step of the exact result even near zero, and ``bias`` is only validated. Without it the
    kernel computes ``fma(x, weight, bias)``. ``out``: see ``FusedMMInputNorm.forward_native``;
    only its leading ``x.shape[0]`` rows are written, and that view is returned.

    CUDA tensors only, unless ``TRITON_INTERPRET=1`` was set before this module was imported.

    :raises UnsupportedDtypeError: ``x`` or ``visual_dtype`` of an unsupported dtype.
    :raises LayoutError: unknown ``layout``, or ``x``'s shape does not hold ``C`` channels.
    :raises KernelInputError: wrong device, or ``weight``/``bias``/``shift`` of the wrong shape,
        dtype or device, or more than 16 channels.
    :raises OutputBufferError: ``out`` of the wrong dtype, shape, device or size, or strided.
    """
    if not x.is_cuda and not isinstance(_fused_norm_kernel, InterpretedFunction):
        raise KernelInputError(
            f"fused_mm_input_norm_triton needs a CUDA tensor, got one on {x.device}; use "
            "FusedMMInputNorm.forward_native, or set TRITON_INTERPRET=1 before importing "
            "aiomm.kernels to run the Triton kernel on the CPU"
        )
    c = weight.numel() if weight.dim() == 1 else -1
    stride = check_call(
        x,
        weight,
        visual_dtype,
        out,
        layout,
        {"weight": (weight, (c,)), "bias": (bias, (c,)), "shift": (shift, (2, c))},
    )
    if c > MAX_KERNEL_CHANNELS:
        raise KernelInputError(
            f"the kernel takes at most {MAX_KERNEL_CHANNELS} channels, got {c}; "
            "use FusedMMInputNorm.forward_native"
        )
    x = x.contiguous()
    dst = torch.empty(x.shape, dtype=visual_dtype, device=x.device) if out is None else out
    n = x.numel()
    if n:
        block, num_warps = _launch_config(n)
        _launch(
            x,
            dst,
            weight,
            bias,
            shift,
            stride,
            block=block,
            num_warps=num_warps,
            int64=n + max(block, stride) > _INT32_MAX,
        )
    return dst if out is None else out[: x.shape[0]]
