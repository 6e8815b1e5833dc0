"""uint8 normalisation on the CPU through a 256-entry table per channel.

A uint8 input has only 256 values per channel, so the fp32 expression of
:meth:`FusedMMInputNorm.forward_native` is evaluated once per value and channel (the module
builds that table and hands it here, see :meth:`FusedMMInputNorm.table`), and every pixel
becomes one table lookup (``numpy.take``, which releases the GIL) instead of four full-size
passes over an fp32 temporary. IEEE operations round the same way element by element, so the
result equals ``forward_native``'s bit for bit. The lookups are fastest when each channel's
elements are contiguous in the output (``NCHW``); other layouts are correct, only slower.
"""

from __future__ import annotations

import numpy as np
import torch

from ._norm_checks import ChannelLayout

__all__ = ("bit_table", "normalize_rows_by_table", "normalize_uint8_by_table")

#: rows looked up per step of ``normalize_rows_by_table``: the step's results stay in cache
#: while they are copied into the output
_CHUNK_ROWS = 512

# Tables hold output bit patterns: numpy has no bfloat16, and a copy of bits is exact anyway.
_BITS = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}


def bit_table(values: torch.Tensor) -> np.ndarray:
    """``values`` (``[C, 256]`` CPU results, entry ``[c, v]`` channel ``c``'s output for ``v``, in
    the output dtype) as a contiguous array of their bit patterns (int16 or int32)."""
    np_bits, torch_bits = _BITS[values.dtype.itemsize]
    return np.ascontiguousarray(values.contiguous().view(torch_bits).numpy()).view(np_bits)


def normalize_uint8_by_table(
    table: np.ndarray,
    x: torch.Tensor,
    visual_dtype: torch.dtype,
    dst: torch.Tensor,
    layout: ChannelLayout,
) -> torch.Tensor:
    """Write ``table[c][x]`` into ``dst`` (contiguous, ``x``'s shape, ``visual_dtype``).

    ``x``: a validated uint8 CPU tensor in ``layout``, any strides.
    """
    c = table.shape[0]
    _, torch_bits = _BITS[visual_dtype.itemsize]
    src = x.numpy()
    out = dst.view(torch_bits).numpy()
    if layout is ChannelLayout.NCHW:
        # [..., C, H, W]: one contiguous output plane per leading index and channel
        src = src.reshape(-1, c, *src.shape[-2:])
        out = out.reshape(-1, c, *out.shape[-2:])
        for n in range(src.shape[0]):
            for ch in range(c):
                np.take(table[ch], src[n, ch], out=out[n, ch], mode="clip")
        return dst
    if layout is ChannelLayout.PATCHES and src.ndim == 2 and src.strides[1] == 1:
        # rows [N, C * K]: looked up a few rows at a time, into a contiguous scratch
        return normalize_rows_by_table(table, x, dst)
    if layout is ChannelLayout.NHWC:
        src_v, out_v = np.moveaxis(src, -1, 0), np.moveaxis(out, -1, 0)
    else:  # PATCHES: [..., C * K], channel-major within a row
        k = src.shape[-1] // c
        src_v = np.moveaxis(src.reshape(*src.shape[:-1], c, k), -2, 0)
        out_v = np.moveaxis(out.reshape(*out.shape[:-1], c, k), -2, 0)
    for ch in range(c):
        np.take(table[ch], src_v[ch], out=out_v[ch], mode="clip")
    return dst


def normalize_rows_by_table(
    table: np.ndarray, rows: torch.Tensor, dst: torch.Tensor, *, times: int = 1
) -> torch.Tensor:
    """Normalise channel-major rows and repeat each channel block ``times`` times, in one pass.

    ``rows``: uint8 ``[N, C * K]`` on the CPU, each row's elements contiguous (``C`` = the
    table's channels). ``dst``: contiguous ``[N, C * times * K]`` of the table's output width;
    block ``c`` of a row becomes ``times`` consecutive copies of ``table[c][block]`` (Qwen-VL's
    temporal frames). Writes every element of ``dst`` exactly once and returns it.
    """
    c = table.shape[0]
    n, width = rows.shape
    k = width // c
    src = rows.numpy().reshape(n, c, k)
    out = dst.view(_BITS[table.itemsize][1]).numpy().reshape(n, c, times, k)
    scratch = np.empty((min(n, _CHUNK_ROWS), k), dtype=table.dtype)
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        step = scratch[: stop - start]
        for ch in range(c):
            # mode="clip" skips numpy's bounds check (uint8 indices cannot exceed 255) and the
            # buffered copy that mode="raise" makes of ``out``
            np.take(table[ch], src[start:stop, ch], out=step, mode="clip")
            for t in range(times):
                out[start:stop, ch, t] = step
    return dst
