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

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from aiomm.errors import KernelInputError

from ._norm_checks import (
    INPUT_DTYPES,
    MAX_KERNEL_CHANNELS,
    OUTPUT_DTYPES,
    ChannelLayout,
    check_call,
    check_repeat,
    expand_repeat,
)
from .table_norm import bit_table, normalize_rows_by_table, normalize_uint8_by_table

__all__ = (
    "INPUT_DTYPES",
    "MAX_KERNEL_CHANNELS",
    "OUTPUT_DTYPES",
    "ChannelLayout",
    "FusedMMInputNorm",
)


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
        if not self._takes_table(x):
            return self.forward_native(x, visual_dtype, out, layout)
        layout = ChannelLayout.parse(layout)
        tables = {"weight": (self.weight, (self.num_channels,))}
        check_call(x, self.weight, visual_dtype, out, layout, tables)
        dst = torch.empty(x.shape, dtype=visual_dtype) if out is None else out[: x.shape[0]]
        return normalize_uint8_by_table(self.table(visual_dtype), x, visual_dtype, dst, layout)

    def forward_rows(
        self,
        x: torch.Tensor,
        visual_dtype: torch.dtype,
        out: torch.Tensor | None = None,
        layout: ChannelLayout | str = ChannelLayout.PATCHES,
        *,
        repeat: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` of rows ``x``, each row's blocks then repeated in place.

        ``repeat=(blocks, times)``: rows ``[n, blocks * width]`` become
        ``[n, blocks * times * width]``, block ``b`` of a row followed by its ``times - 1``
        copies (Qwen-VL's temporal frames, ``MultiModalFieldConfig.repeat``); ``None`` or
        ``times == 1`` is plain :meth:`forward`. The result equals ``forward(x)`` so expanded, bit
        for bit. uint8 CPU rows in ``PATCHES`` with one block per channel are looked up and
        repeated in one pass over the output, with no compact intermediate; other inputs are
        normalised compact by :meth:`forward` and expanded in one copy. ``out``: as for
        :meth:`forward_native`, with rows of the expanded length.

        :raises KernelInputError: ``repeat`` does not fit ``x`` (not 2-D, a count below 1, or a
            row length that ``blocks`` does not divide), and the errors of :meth:`forward_native`.
        """
        if repeat is None:
            return self.forward(x, visual_dtype, out, layout)
        blocks, times = check_repeat(x, repeat)
        if times == 1:
            return self.forward(x, visual_dtype, out, layout)
        layout = ChannelLayout.parse(layout)
        n, width = x.shape
        row = (width * times,)
        tables = {"weight": (self.weight, (self.num_channels,))}
        check_call(x, self.weight, visual_dtype, out, layout, tables, out_row_shape=row)
        dst = (
            torch.empty((n, *row), dtype=visual_dtype, device=x.device) if out is None else out[:n]
        )
        if layout is ChannelLayout.PATCHES and blocks == self.num_channels and self._takes_table(x):
            rows = x if x.stride(-1) == 1 else x.contiguous()
            return normalize_rows_by_table(self.table(visual_dtype), rows, dst, times=times)
        y = self.forward(x, visual_dtype, layout=layout)
        dst.view(n, blocks, times, width // blocks).copy_(expand_repeat(y, (blocks, times)))
        return dst

    def table(self, visual_dtype: torch.dtype) -> np.ndarray:
        """``[C, 256]`` output bit patterns (int16 or int32): entry ``[c, v]`` is
        :meth:`forward_native`'s result for value ``v`` of channel ``c``, in ``visual_dtype``.
        Built once per dtype; the module must be on the CPU."""
        table = self._tables.get(visual_dtype)
        if table is None:
            c = self.num_channels
            values = torch.arange(256, dtype=torch.uint8).expand(c, 256).unsqueeze(-1)
            native = self.forward_native(values, visual_dtype, layout=ChannelLayout.NCHW)
            # a race builds the same table twice; both are correct
            table = self._tables[visual_dtype] = bit_table(native[..., 0])
        return table

    @staticmethod
    def _takes_table(x: torch.Tensor) -> bool:
        return x.dtype == torch.uint8 and x.device.type == "cpu" and not x.requires_grad

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
        param_shape: tuple[int, ...]
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
