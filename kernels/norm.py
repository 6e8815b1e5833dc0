"""Fused input normalisation for vision towers: ``FusedMMInputNorm`` and its channel layouts.

``y = x * weight[c] + bias[c]`` with ``weight = rescale_factor / std`` and ``bias = -mean / std``,
i.e. ``(x * rescale_factor - mean) / std``, computed in fp32 and written in ``visual_dtype``. The
channel of an element is ``(flat_index // channel_stride) % num_channels`` in the contiguous
row-major tensor; :class:`ChannelLayout` names the three layouts that rule covers.

Both paths evaluate the same fp32 expression, ``((x - shift_hi[c]) - shift_lo[c]) * weight[c]``,
where ``shift_hi + shift_lo`` is ``mean / rescale_factor`` to about 48 bits. Unlike a plain
``x * weight + bias``, it has no cancellation error when the result is near zero, so every output
is within one rounding step of the exact value, in any output dtype. This module imports no Triton;
the kernel lives in ``_triton_norm.py`` and is imported on the first CUDA call.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from aiomm.errors import KernelInputError, LayoutError, OutputBufferError, UnsupportedDtypeError

from ._enums import parse_member

__all__ = (
    "INPUT_DTYPES",
    "MAX_KERNEL_CHANNELS",
    "OUTPUT_DTYPES",
    "ChannelLayout",
    "FusedMMInputNorm",
)

INPUT_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The kernel selects a channel's constants with an unrolled chain; wider inputs go native.
MAX_KERNEL_CHANNELS = 16


class ChannelLayout(enum.Enum):
    """Where the channel axis sits in a contiguous row-major tensor.

    ``NCHW``: ``[..., C, H, W]``, channel stride ``H * W``. ``NHWC``: ``[..., C]``, stride 1.
    ``PATCHES``: rows ``[..., C * K]`` whose channel blocks are contiguous (channel-major within a
    row, as Qwen2-VL-style processors emit ``[num_patches, C * T * P * P]``), stride ``K``.
    """

    NCHW = "nchw"
    NHWC = "nhwc"
    PATCHES = "patches"

    @classmethod
    def parse(cls, layout: ChannelLayout | str) -> ChannelLayout:
        """Return ``layout`` as a member; strings are matched case-insensitively.

        :raises LayoutError: for an unknown name or a value of another type.
        """
        return parse_member(cls, layout, LayoutError, "channel layout")

    def channel_stride(self, shape: Sequence[int], num_channels: int) -> int:
        """The number of consecutive elements that share a channel, for a tensor of ``shape``.

        :raises LayoutError: if ``shape`` does not hold ``num_channels`` channels in this layout.
        """
        shape = tuple(shape)
        c = num_channels
        if self is ChannelLayout.NCHW:
            if len(shape) >= 3 and shape[-3] == c:
                return shape[-2] * shape[-1]
            need = f"[..., {c}, H, W] (ndim >= 3, shape[-3] == {c})"
        elif self is ChannelLayout.NHWC:
            if len(shape) >= 2 and shape[-1] == c:
                return 1
            need = f"[..., {c}] (ndim >= 2, shape[-1] == {c})"
        else:
            if len(shape) >= 2 and shape[-1] % c == 0:
                return shape[-1] // c
            need = f"[..., {c} * K] (ndim >= 2, shape[-1] divisible by {c})"
        raise LayoutError(
            f"shape {list(shape)} does not fit layout {self.name} with {c} channel(s): "
            f"expected {need}"
        )


def check_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    visual_dtype: torch.dtype,
    out: torch.Tensor | None,
    layout: ChannelLayout | str,
    tables: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]],
) -> int:
    """Validate one call of either path and return the channel stride.

    ``tables`` maps a name to ``(tensor, expected shape)`` for the fp32 constants.

    :raises UnsupportedDtypeError: ``x`` or ``visual_dtype`` of a dtype the kernel does not take.
    :raises LayoutError: unknown ``layout``, or ``x``'s shape does not hold ``C`` channels.
    :raises KernelInputError: constants of the wrong shape, dtype or device.
    :raises OutputBufferError: ``out`` of the wrong dtype, shape, device or size, or not contiguous.
    """
    if x.dtype not in INPUT_DTYPES:
        raise UnsupportedDtypeError(
            f"input dtype {x.dtype} is not supported; expected one of {list(INPUT_DTYPES)}"
        )
    if visual_dtype not in OUTPUT_DTYPES:
        raise UnsupportedDtypeError(
            f"visual_dtype {visual_dtype} is not supported; expected one of {list(OUTPUT_DTYPES)}"
        )
    if weight.dim() != 1 or weight.numel() < 1:
        raise KernelInputError(f"weight must be 1-D with C >= 1 entries, got {list(weight.shape)}")
    num_channels = weight.numel()
    for name, (t, shape) in tables.items():
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise KernelInputError(
                f"{name} must be float32 of shape {list(shape)} for {num_channels} channel(s), "
                f"got {t.dtype} of shape {list(t.shape)}"
            )
        if t.device != x.device or not t.is_contiguous():
            raise KernelInputError(
                f"{name} must be contiguous and on x's device {x.device}, got {t.device}; "
                "move the module with .to(x.device)"
            )
    stride = ChannelLayout.parse(layout).channel_stride(x.shape, num_channels)
    if out is not None:
        if out.dtype != visual_dtype:
            raise OutputBufferError(f"out has dtype {out.dtype}, visual_dtype is {visual_dtype}")
        if out.device != x.device:
            raise OutputBufferError(f"out is on {out.device}, x is on {x.device}")
        if out.dim() != x.dim() or out.shape[1:] != x.shape[1:]:
            raise OutputBufferError(
                f"out has shape {list(out.shape)}; it must be [>= {x.shape[0]}, "
                f"{', '.join(map(str, x.shape[1:]))}] for x of shape {list(x.shape)}"
            )
        if out.shape[0] < x.shape[0]:
            raise OutputBufferError(
                f"out holds {out.shape[0]} rows along dim 0, x needs {x.shape[0]}"
            )
        if not out.is_contiguous():
            raise OutputBufferError("out must be contiguous")
    return stride


class FusedMMInputNorm(nn.Module):
    """Turns raw pixels (uint8 or float) into normalised vision-tower input in one pass.

    The constants are fp32 buffers (not persistent in ``state_dict``): ``weight`` and ``bias``
    of shape ``[C]``, and ``shift`` of shape ``[2, C]`` (hi and lo parts of
    ``mean / rescale_factor``). Move the module to the input's device with ``.to(device)``; do not
    cast it to another dtype.

    :raises KernelInputError: if mean and std differ in length or are empty, or if
        ``rescale_factor`` or a std is zero or not finite.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    shift: torch.Tensor

    def __init__(
        self, rescale_factor: float, image_mean: Sequence[float], image_std: Sequence[float]
    ) -> None:
        super().__init__()
        r = float(rescale_factor)
        mean = [float(m) for m in image_mean]
        std = [float(s) for s in image_std]
        if not mean or len(mean) != len(std):
            raise KernelInputError(
                f"image_mean and image_std need the same number (>= 1) of channels, "
                f"got {len(mean)} and {len(std)}"
            )
        if not (math.isfinite(r) and r != 0.0):
            raise KernelInputError(f"rescale_factor must be finite and non-zero, got {r}")
        if not all(math.isfinite(s) and s != 0.0 for s in std) or not all(map(math.isfinite, mean)):
            raise KernelInputError(f"image_std must be finite and non-zero, got {std}")
        self.rescale_factor = r
        self.image_mean = tuple(mean)
        self.image_std = tuple(std)
        shift = [m / r for m in mean]  # float64
        shift_hi = torch.tensor(shift, dtype=torch.float32)
        shift_lo = torch.tensor(
            [s - h for s, h in zip(shift, shift_hi.tolist(), strict=True)], dtype=torch.float32
        )
        weight = [r / s for s in std]
        bias = [-m / s for m, s in zip(mean, std, strict=True)]
        self.register_buffer("weight", torch.tensor(weight, dtype=torch.float32), False)
        self.register_buffer("bias", torch.tensor(bias, dtype=torch.float32), False)
        self.register_buffer("shift", torch.stack([shift_hi, shift_lo]), False)
        self._tables: dict[torch.dtype, Any] = {}

    @property
    def num_channels(self) -> int:
        return self.weight.numel()

    def extra_repr(self) -> str:
        return (
            f"rescale_factor={self.rescale_factor}, image_mean={list(self.image_mean)}, "
            f"image_std={list(self.image_std)}"
        )

    def forward(
        self,
        x: torch.Tensor,
        visual_dtype: torch.dtype,
        out: torch.Tensor | None = None,
        layout: ChannelLayout | str = ChannelLayout.NCHW,
    ) -> torch.Tensor:
        """Normalise ``x``: the Triton kernel for CUDA tensors; on the CPU the table path for
        uint8 (:meth:`forward_table`, same bits) and pure torch otherwise.

        Arguments and errors are those of :meth:`forward_native`. More than
        ``MAX_KERNEL_CHANNELS`` channels run natively on any device.
        """
        if x.is_cuda and self.num_channels <= MAX_KERNEL_CHANNELS:
            return self.forward_cuda(x, visual_dtype, out, layout)
        return self.forward_table(x, visual_dtype, out, layout)  # native for all but CPU uint8

    def forward_cuda(
        self,
        x: torch.Tensor,
        visual_dtype: torch.dtype,
        out: torch.Tensor | None = None,
        layout: ChannelLayout | str = ChannelLayout.NCHW,
    ) -> torch.Tensor:
        """One launch of the fused Triton kernel; see ``fused_mm_input_norm_triton``.

        Arguments and errors are those of :meth:`forward_native`; CPU tensors are accepted only
        when ``TRITON_INTERPRET=1`` was set before the kernel module was imported.
        """
        from ._triton_norm import fused_mm_input_norm_triton

        return fused_mm_input_norm_triton(
            x,
            self.weight,
            self.bias,
            visual_dtype=visual_dtype,
            out=out,
            layout=layout,
            shift=self.shift,
        )

    def forward_table(
        self,
        x: torch.Tensor,
        visual_dtype: torch.dtype,
        out: torch.Tensor | None = None,
        layout: ChannelLayout | str = ChannelLayout.NCHW,
    ) -> torch.Tensor:
        """The CPU fast path: uint8 ``x`` through a 256-entry table per channel.

        Arguments, result and errors are those of :meth:`forward_native`, and so are the bits
        of the result; inputs that are not uint8 CPU tensors run :meth:`forward_native` itself.
        The lookups release the GIL, so worker threads normalise in parallel.
        """
        if x.dtype != torch.uint8 or x.device.type != "cpu" or x.requires_grad:
            return self.forward_native(x, visual_dtype, out, layout)
        from .table_norm import normalize_uint8_by_table

        layout = ChannelLayout.parse(layout)
        tables = {"weight": (self.weight, (self.num_channels,))}
        check_call(x, self.weight, visual_dtype, out, layout, tables)
        dst = torch.empty(x.shape, dtype=visual_dtype) if out is None else out[: x.shape[0]]
        return normalize_uint8_by_table(self.table(visual_dtype), x, visual_dtype, dst, layout)

    def table(self, visual_dtype: torch.dtype) -> np.ndarray:
        """``[C, 256]`` output bit patterns (int16 or int32): entry ``[c, v]`` is
        :meth:`forward_native`'s result for value ``v`` of channel ``c``, in ``visual_dtype``.
        Built once per dtype; the module must be on the CPU."""
        from .table_norm import normalization_table

        table = self._tables.get(visual_dtype)
        if table is None:
            # a race builds the same table twice; both are correct
            table = self._tables[visual_dtype] = normalization_table(self, visual_dtype)
        return table

    def forward_native(
        self,
        x: torch.Tensor,
        visual_dtype: torch.dtype,
        out: torch.Tensor | None = None,
        layout: ChannelLayout | str = ChannelLayout.NCHW,
    ) -> torch.Tensor:
        """Pure-torch normalisation, the specification and test oracle of the kernel.

        ``x`` is uint8, float16, bfloat16 or float32 in ``layout``, any strides; the result has
        ``x``'s shape and dtype ``visual_dtype`` (bfloat16, float16 or float32). With ``out``
        (contiguous, ``visual_dtype``, ``out.shape[1:] == x.shape[1:]``,
        ``out.shape[0] >= x.shape[0]``) only its leading ``x.shape[0]`` rows are written and that
        view is returned. It evaluates the kernel's fp32 expression op by op, so its fp32 results
        are bit-identical; it does materialise one fp32 temporary of ``x``'s size.

        :raises UnsupportedDtypeError: ``x`` or ``visual_dtype`` of an unsupported dtype.
        :raises LayoutError: unknown ``layout``, or ``x``'s shape does not hold ``C`` channels.
        :raises KernelInputError: the module's constants are not on ``x``'s device.
        :raises OutputBufferError: ``out`` of the wrong dtype, shape, device or size, or strided.
        """
        c = self.num_channels
        layout = ChannelLayout.parse(layout)
        tables = {"weight": (self.weight, (c,)), "shift": (self.shift, (2, c))}
        check_call(x, self.weight, visual_dtype, out, layout, tables)
        if layout is ChannelLayout.NCHW:
            xv, param_shape = x, (c, 1, 1)
        elif layout is ChannelLayout.NHWC:
            xv, param_shape = x, (c,)
        else:
            xv, param_shape = x.unflatten(-1, (c, x.shape[-1] // c)), (c, 1)
        # uint8/fp16/bf16 - fp32 promotes to fp32 element by element, with no fp32 copy of x.
        y = torch.sub(xv, self.shift[0].view(param_shape))
        y.sub_(self.shift[1].view(param_shape)).mul_(self.weight.view(param_shape))
        y = y.reshape(x.shape)
        if out is None:
            return y.to(visual_dtype, memory_format=torch.contiguous_format)
        dst = out[: x.shape[0]]
        dst.copy_(y)
        return dst
