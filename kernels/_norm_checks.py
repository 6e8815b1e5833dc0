"""Dtypes, channel layouts and argument checks shared by ``FusedMMInputNorm`` and its launchers.

The bottom of the normalisation modules: ``norm.py`` (the module), ``_triton_norm.py`` (the
Triton launcher) and ``table_norm.py`` (the CPU table lookups) import from here and never from
each other upwards, so the three form no import cycle.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import torch

from aiomm.errors import KernelInputError, LayoutError, OutputBufferError, UnsupportedDtypeError

from ._enums import parse_member

__all__ = (
    "INPUT_DTYPES",
    "MAX_KERNEL_CHANNELS",
    "OUTPUT_DTYPES",
    "ChannelLayout",
    "check_call",
    "check_out",
    "check_repeat",
    "expand_repeat",
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
    tables: Mapping[str, tuple[torch.Tensor | None, tuple[int, ...]]],
    *,
    out_row_shape: Sequence[int] | None = None,
) -> int:
    """Validate one call of any path and return the channel stride.

    ``tables`` maps a name to ``(tensor, expected shape)`` for the fp32 constants.
    ``out_row_shape``: the shape of one row of the result (default ``x.shape[1:]``).

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
        check_out(out, x, visual_dtype, x.shape[1:] if out_row_shape is None else out_row_shape)
    return stride


def check_out(
    out: torch.Tensor, x: torch.Tensor, visual_dtype: torch.dtype, row_shape: Sequence[int]
) -> None:
    """``out`` must take ``x.shape[0]`` result rows of ``row_shape`` in ``visual_dtype``.

    :raises OutputBufferError: ``out`` of the wrong dtype, shape, device or size, or not contiguous.
    """
    row_shape = tuple(row_shape)
    if out.dtype != visual_dtype:
        raise OutputBufferError(f"out has dtype {out.dtype}, visual_dtype is {visual_dtype}")
    if out.device != x.device:
        raise OutputBufferError(f"out is on {out.device}, x is on {x.device}")
    if out.dim() != 1 + len(row_shape) or tuple(out.shape[1:]) != row_shape:
        raise OutputBufferError(
            f"out has shape {list(out.shape)}; it must be [>= {x.shape[0]}, "
            f"{', '.join(map(str, row_shape))}] for x of shape {list(x.shape)}"
        )
    if out.shape[0] < x.shape[0]:
        raise OutputBufferError(f"out holds {out.shape[0]} rows along dim 0, x needs {x.shape[0]}")
    if not out.is_contiguous():
        raise OutputBufferError("out must be contiguous")


def check_repeat(x: torch.Tensor, repeat: tuple[int, int]) -> tuple[int, int]:
    """``(blocks, times)`` validated for rows ``x`` of shape ``[n, blocks * width]``.

    :raises KernelInputError: ``x`` is not 2-D, a count below 1, or a row length that
        ``blocks`` does not divide.
    """
    try:
        blocks, times = (int(v) for v in repeat)
    except (TypeError, ValueError):
        raise KernelInputError(f"repeat must be (blocks, times), got {repeat!r}") from None
    if blocks < 1 or times < 1 or x.dim() != 2 or x.shape[1] % blocks:
        raise KernelInputError(
            f"repeat={tuple(repeat)} needs rows [n, blocks * width] and counts >= 1, got x of "
            f"shape {list(x.shape)}"
        )
    return blocks, times


def expand_repeat(x: torch.Tensor, repeat: tuple[int, int]) -> torch.Tensor:
    """Compact rows ``x`` ``[n, blocks * width]`` as the view ``[n, blocks, times, width]``
    whose flattening after dim 0 repeats each block ``times`` times in place: the one
    definition of the frame repeat (``Repeat`` of a field config, the device stage's copy and
    :meth:`FusedMMInputNorm.forward_rows` all use it; the table pass writes the same layout).

    :raises KernelInputError: see :func:`check_repeat`.
    """
    blocks, times = check_repeat(x, repeat)
    n, width = x.shape[0], x.shape[1] // blocks
    return x.reshape(n, blocks, 1, width).expand(n, blocks, times, width)
