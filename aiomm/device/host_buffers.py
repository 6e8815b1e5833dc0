"""Recycled host memory for large CPU output tensors.

On a CPU device the engine hands each request a freshly allocated ``pixel_values`` tensor of tens
of megabytes (a 1 MP Qwen-VL image is 24 MB of fp32 rows). Allocations that large are served by
fresh ``mmap`` regions, which the kernel zero-fills page by page on first touch: measured on the
streaming benchmark, writing the result into new pages took a fifth of the engine's CPU time.

:class:`HostBufferPool` lends tensors whose memory comes from blocks it keeps. A block goes back
to the pool when the last tensor (or view, or storage) using it is freed, which the pool learns
from a ``weakref.finalize`` on the array that the tensor's storage owns. Idle blocks are bounded
by ``max_idle_bytes``: a block returned beyond that bound is unmapped. Lent tensors are ordinary
CPU tensors, except that their storage cannot be resized (like any ``torch.from_numpy`` tensor).

Thread-safe: tensors may be taken in one thread and freed in any other.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
import torch

__all__ = ("HostBufferPool", "HostBufferPoolStatistics")

_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class HostBufferPoolStatistics:
    """A snapshot of a :class:`HostBufferPool`."""

    #: tensors lent from pooled blocks, and how many of them reused an idle block
    lent: int
    reused: int
    #: blocks mapped so far, and bytes held by blocks that are idle now
    blocks_created: int
    idle_blocks: int
    idle_bytes: int
    #: requests below ``min_bytes``, served by torch's allocator
    small: int


def _block_size(nbytes: int) -> int:
    """``nbytes`` rounded up to 1, 1.25, 1.5 or 1.75 times a power of two, in whole pages:
    at most a quarter wasted, and nearby sizes share blocks."""
    top = 1 << (max(nbytes - 1, 1).bit_length() - 1)
    step = max(top // 4, _PAGE)
    size = -(-nbytes // step) * step
    return -(-size // _PAGE) * _PAGE


class HostBufferPool:
    """Lends CPU tensors backed by reusable blocks (see the module docstring).

    ``max_idle_bytes`` bounds the memory held by idle blocks (0 disables reuse: every tensor
    comes from torch's allocator); requests below ``min_bytes`` always do.
    """

    def __init__(self, max_idle_bytes: int = 256 << 20, *, min_bytes: int = 1 << 20) -> None:
        if max_idle_bytes < 0 or min_bytes < 0:
            raise ValueError("max_idle_bytes and min_bytes must be >= 0")
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        # idle blocks sorted by size; the parallel list of sizes is bisect's key
        self._sizes: list[int] = []
        self._idle: list[mmap.mmap] = []
        self._idle_bytes = 0
        self._lent = self._reused = self._created = self._small = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        nbytes = prod(shape) * dtype.itemsize
        if nbytes < max(self.min_bytes, 1) or self.max_idle_bytes == 0:
            with self._lock:
                self._small += 1
            return torch.empty(tuple(shape), dtype=dtype)
        block = self._take(nbytes)
        array = np.frombuffer(block, dtype=np.uint8, count=nbytes)
        # The storage owns ``array``; when the last user of the memory goes, so does ``array``.
        done = weakref.finalize(array, _give_back, weakref.ref(self), block)
        done.atexit = False  # at exit the memory goes with the process
        return torch.from_numpy(array).view(dtype).view(tuple(shape))

    def statistics(self) -> HostBufferPoolStatistics:
        with self._lock:
            return HostBufferPoolStatistics(
                lent=self._lent,
                reused=self._reused,
                blocks_created=self._created,
                idle_blocks=len(self._idle),
                idle_bytes=self._idle_bytes,
                small=self._small,
            )

    def clear(self) -> None:
        """Drop every idle block (lent ones are dropped when they come back beyond the bound)."""
        with self._lock:
            self._sizes.clear()
            self._idle.clear()
            self._idle_bytes = 0

    def _take(self, nbytes: int) -> mmap.mmap:
        size = _block_size(nbytes)
        with self._lock:
            self._lent += 1
            # the smallest idle block that holds nbytes, if it wastes at most half of itself
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= 2 * size:
                self._reused += 1
                self._idle_bytes -= self._sizes.pop(i)
                return self._idle.pop(i)
            self._created += 1
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # fewer, larger page faults on the block's first use, where the kernel allows it
            block.madvise(mmap.MADV_HUGEPAGE)
        return block

    def _put(self, block: mmap.mmap) -> None:
        size = len(block)
        with self._lock:
            if self._idle_bytes + size > self.max_idle_bytes:
                return  # beyond the bound: unmapped once the last reference goes
            i = bisect.bisect_left(self._sizes, size)
            self._sizes.insert(i, size)
            self._idle.insert(i, block)
            self._idle_bytes += size


def _give_back(pool_ref: weakref.ref[HostBufferPool], block: mmap.mmap) -> None:
    pool = pool_ref()
    if pool is not None:
        pool._put(block)
