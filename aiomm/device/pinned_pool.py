"""A bounded pool of (pinned) host staging buffers for host-to-device copies.

A buffer is allocated once per slot and reused across requests; ``max_buffers`` slots bound the
pool, and a slot grows (to the next power of two, at most ``max_buffer_bytes``) only when a request
needs more than it holds, so the pool never holds more than ``max_buffers * max_buffer_bytes``.
When every slot is lent, :meth:`PinnedBufferPool.acquire` waits, first come first served: the
pool's capacity is backpressure, never an unbounded allocation.

A buffer is not reusable until the device work that reads it has completed. The borrower marks the
buffer with a :class:`CopyFence` (on CUDA, :class:`CudaEventFence` on the event recorded after the
copy) and the pool returns the slot only once the fence reports completion: ``release_after``
waits for it, shielded from cancellation, in a worker thread; a plain ``release`` of a buffer
whose fence is still pending parks the slot until a later ``query()`` sees it done. Allocation
(``cudaHostAlloc`` is slow and takes locks) runs in a worker thread too.

Runs on the event loop; the allocator and the fence waits run in worker threads.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

__all__ = (
    "CopyFence",
    "CudaEventFence",
    "PinnedBuffer",
    "PinnedBufferPool",
    "PinnedPoolStatistics",
    "default_allocator",
)


class CopyFence(Protocol):
    """Completion of the device work that reads a staging buffer."""

    def query(self) -> bool:
        """True once the work has completed; never blocks."""
        ...

    async def wait(self) -> None:
        """Wait for completion without blocking the event loop."""
        ...


class CudaEventFence:
    """A :class:`CopyFence` on a recorded ``torch.cuda.Event``; waits in a worker thread."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def query(self) -> bool:
        return bool(self.event.query())

    async def wait(self) -> None:
        if not self.event.query():
            # Abandoning the thread on cancel is harmless: it only blocks on the event.
            await anyio.to_thread.run_sync(self.event.synchronize, abandon_on_cancel=True)


def default_allocator(pin_memory: bool) -> Callable[[int], torch.Tensor]:
    """An allocator of 1-D uint8 host tensors, page-locked when ``pin_memory``."""

    def allocate(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)

    return allocate


@dataclass(frozen=True)
class PinnedPoolStatistics:
    """A snapshot of a :class:`PinnedBufferPool`."""

    #: slots in the pool (``max_buffers``)
    capacity: int
    #: slots that hold memory
    allocated: int
    #: buffers lent out now
    in_use: int
    #: released buffers whose copy has not completed yet (not reusable)
    in_flight: int
    #: tasks waiting in ``acquire``
    waiting: int
    #: bytes held by the slots now
    total_bytes: int
    #: the bound on ``total_bytes``: ``capacity * max_buffer_bytes``
    max_total_bytes: int
    peak_in_use: int
    acquisitions: int
    #: allocations (first ones and growths)
    grows: int
    pinned: bool


class _Slot:
    __slots__ = ("grows", "index", "tensor")

    def __init__(self, index: int) -> None:
        self.index = index
        self.tensor: torch.Tensor | None = None
        self.grows = 0

    @property
    def capacity(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()


class _Waiter:
    __slots__ = ("event", "slot")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.slot: _Slot | None = None


class PinnedBuffer:
    """One hand-out of a pool slot: ``nbytes`` of host memory, valid until released.

    ``tensor`` and ``view`` raise ``RuntimeError`` once the buffer went back to its pool.
    """

    __slots__ = ("_pool", "_released", "_slot", "fence", "nbytes")

    def __init__(self, pool: PinnedBufferPool, slot: _Slot, nbytes: int) -> None:
        self._pool = pool
        self._slot = slot
        self._released = False
        self.nbytes = nbytes
        self.fence: CopyFence | None = None

    @property
    def index(self) -> int:
        """The slot this buffer occupies (stable across hand-outs, for accounting)."""
        return self._slot.index

    @property
    def released(self) -> bool:
        return self._released

    @property
    def tensor(self) -> torch.Tensor:
        """The ``nbytes`` uint8 bytes lent, as a 1-D tensor."""
        if self._released or self._slot.tensor is None:
            raise RuntimeError(f"staging buffer {self.index} was released to its pool")
        return self._slot.tensor[: self.nbytes]

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The leading bytes as a contiguous tensor of ``dtype`` and ``shape``.

        :raises ValueError: if that needs more than ``nbytes`` bytes.
        """
        need = math.prod(shape) * dtype.itemsize
        if need > self.nbytes:
            raise ValueError(f"a {dtype} tensor of shape {list(shape)} needs {need} bytes, "
                             f"this buffer lends {self.nbytes}")  # fmt: skip
        return self.tensor[:need].view(dtype).view(tuple(shape))

    def mark_in_flight(self, fence: CopyFence) -> None:
        """Device work reading this buffer was enqueued; the slot is reusable once ``fence`` is."""
        self.fence = fence


class PinnedBufferPool:
    """At most ``max_buffers`` reusable host buffers; ``acquire`` waits when all are lent.

    ``allocator(nbytes)`` returns a 1-D uint8 tensor of at least ``nbytes`` elements; by default
    a pinned one when ``pin_memory`` (default: CUDA is available), an ordinary one otherwise.
    ``release_timeout`` bounds how long ``release_after`` waits for a fence before it parks the
    slot (still unusable) and returns.

    :raises ValueError: for a non-positive size or count.
    """

    def __init__(
        self,
        max_buffers: int,
        *,
        buffer_bytes: int = 16 << 20,
        max_buffer_bytes: int = 256 << 20,
        allocator: Callable[[int], torch.Tensor] | None = None,
        pin_memory: bool | None = None,
        release_timeout: float = 60.0,
        poll_interval: float = 0.005,
    ) -> None:
        if not isinstance(max_buffers, int) or max_buffers < 1:
            raise ValueError(f"{max_buffers=} must be a positive integer")
        if buffer_bytes < 1 or max_buffer_bytes < buffer_bytes:
            raise ValueError(f"need 1 <= {buffer_bytes=} <= {max_buffer_bytes=}")
        if release_timeout <= 0 or poll_interval <= 0:
            raise ValueError(f"{release_timeout=} and {poll_interval=} must be positive")
        if allocator is None:
            if pin_memory is None:
                pin_memory = torch.cuda.is_available()
            allocator = default_allocator(pin_memory)
        self.max_buffers = max_buffers
        self.buffer_bytes = buffer_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self._allocator = allocator
        self._pinned = bool(pin_memory)
        self._release_timeout = release_timeout
        self._poll_interval = poll_interval
        self._slots = [_Slot(i) for i in range(max_buffers)]
        self._free: list[_Slot] = list(self._slots)
        self._lent: dict[int, PinnedBuffer] = {}
        self._parked: list[tuple[CopyFence, _Slot]] = []
        self._waiters: deque[_Waiter] = deque()
        self._grow_lock = threading.Lock()
        self._peak = 0
        self._acquisitions = 0

    # ------------------------------------------------------------------ acquire

    def fits(self, nbytes: int) -> bool:
        """Whether one buffer can hold ``nbytes`` (at most ``max_buffer_bytes``)."""
        return 0 <= nbytes <= self.max_buffer_bytes

    async def acquire(self, nbytes: int) -> PinnedBuffer:
        """A buffer of at least ``nbytes``; waits (in FIFO order) while every slot is in use.

        :raises ValueError: if ``nbytes`` exceeds ``max_buffer_bytes``.
        """
        self._check_size(nbytes)
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._reclaim()
        if self._free and not self._waiters:
            slot = self._pick(nbytes)
            waited = False
        else:
            slot = await self._wait_for_slot()
            waited = True
        try:
            if self._needs_growth(slot, nbytes):
                await anyio.to_thread.run_sync(self._grow, slot, nbytes)
            elif not waited:
                await anyio.lowlevel.cancel_shielded_checkpoint()
        except BaseException:
            self._put_back(slot)
            raise
        return self._lend(slot, nbytes)

    def acquire_nowait(self, nbytes: int) -> PinnedBuffer:
        """Like :meth:`acquire` without waiting; a needed allocation runs on this thread.

        :raises anyio.WouldBlock: if no slot is free (or tasks are already waiting).
        :raises ValueError: if ``nbytes`` exceeds ``max_buffer_bytes``.
        """
        self._check_size(nbytes)
        self._reclaim()
        if not self._free or self._waiters:
            raise anyio.WouldBlock
        slot = self._pick(nbytes)
        try:
            if self._needs_growth(slot, nbytes):
                self._grow(slot, nbytes)
        except BaseException:
            self._put_back(slot)
            raise
        return self._lend(slot, nbytes)

    @asynccontextmanager
    async def lease(self, nbytes: int) -> AsyncIterator[PinnedBuffer]:
        """``acquire`` on entry; on exit (errors and cancellation too) ``release_after``."""
        buffer = await self.acquire(nbytes)
        try:
            yield buffer
        finally:
            await self.release_after(buffer)

    async def preallocate(self, count: int | None = None) -> None:
        """Allocate ``buffer_bytes`` in up to ``count`` (default: all) slots ahead of traffic."""
        count = self.max_buffers if count is None else min(count, self.max_buffers)
        taken: list[PinnedBuffer] = []
        try:
            for _ in range(count):
                taken.append(await self.acquire(self.buffer_bytes))
        finally:
            for buffer in taken:
                self.release(buffer)

    # ------------------------------------------------------------------ release

    def release(self, buffer: PinnedBuffer) -> None:
        """Return ``buffer``; a slot whose fence is still pending is parked until it completes.

        :raises RuntimeError: if ``buffer`` is not lent by this pool (or was already released).
        """
        if buffer._pool is not self or self._lent.get(buffer.index) is not buffer:
            raise RuntimeError(
                f"staging buffer {buffer.index} is not lent by this pool (released twice?)"
            )
        del self._lent[buffer.index]
        buffer._released = True
        fence = buffer.fence
        if fence is not None and not fence.query():
            self._parked.append((fence, buffer._slot))
            for waiter in self._waiters:
                waiter.event.set()  # wake them to poll the parked slot's fence
            return
        self._put_back(buffer._slot)

    async def release_after(self, buffer: PinnedBuffer) -> None:
        """Wait (shielded, at most ``release_timeout``) for the buffer's fence, then release it."""
        fence = buffer.fence
        try:
            if fence is not None and not fence.query():
                with anyio.move_on_after(self._release_timeout, shield=True):
                    await fence.wait()
        finally:
            self.release(buffer)

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> PinnedPoolStatistics:
        """A snapshot; parked slots whose copy has completed are returned to the pool first."""
        self._reclaim()
        total = sum(s.capacity for s in self._slots)
        return PinnedPoolStatistics(
            capacity=self.max_buffers,
            allocated=sum(1 for s in self._slots if s.tensor is not None),
            in_use=len(self._lent),
            in_flight=len(self._parked),
            waiting=len(self._waiters),
            total_bytes=total,
            max_total_bytes=self.max_buffers * self.max_buffer_bytes,
            peak_in_use=self._peak,
            acquisitions=self._acquisitions,
            grows=sum(s.grows for s in self._slots),
            pinned=self._pinned,
        )

    # ------------------------------------------------------------------ internals

    def _check_size(self, nbytes: int) -> None:
        if not self.fits(nbytes):
            raise ValueError(
                f"a staging buffer of {nbytes} bytes was asked for; the pool lends 0 to "
                f"max_buffer_bytes={self.max_buffer_bytes}"
            )

    def _pick(self, nbytes: int) -> _Slot:
        """Best fit among free slots; else an empty slot; else the largest (to be grown)."""
        fitting = [s for s in self._free if s.tensor is not None and s.capacity >= nbytes]
        if fitting:
            slot = min(fitting, key=lambda s: s.capacity)
        else:
            empty = [s for s in self._free if s.tensor is None]
            slot = empty[0] if empty else max(self._free, key=lambda s: s.capacity)
        self._free.remove(slot)
        return slot

    async def _wait_for_slot(self) -> _Slot:
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            while waiter.slot is None:
                if self._parked:
                    # A parked slot frees itself only when someone looks: poll while waiting.
                    with anyio.move_on_after(self._poll_interval):
                        await waiter.event.wait()
                    self._reclaim()
                else:
                    await waiter.event.wait()
                if waiter.slot is None and waiter.event.is_set():
                    waiter.event = anyio.Event()  # woken by a parked slot, not a hand-off
        except BaseException:
            if waiter.slot is not None:
                # Handed a slot as we were cancelled: pass it on to the next waiter.
                self._put_back(waiter.slot)
            else:
                self._waiters.remove(waiter)
            raise
        return waiter.slot

    def _needs_growth(self, slot: _Slot, nbytes: int) -> bool:
        return slot.tensor is None or slot.capacity < nbytes

    def _target_size(self, nbytes: int) -> int:
        size = 1 << max(nbytes - 1, 0).bit_length()
        return min(max(size, self.buffer_bytes), self.max_buffer_bytes)

    def _grow(self, slot: _Slot, nbytes: int) -> None:
        """Runs in a worker thread (or in ``acquire_nowait``'s caller); the slot is ours alone."""
        size = self._target_size(nbytes)
        slot.tensor = None  # drop the old buffer first, so the footprint stays bounded
        tensor = self._allocator(size)
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() < nbytes:
            raise RuntimeError(
                f"the allocator returned a {tensor.dtype} tensor of shape {list(tensor.shape)} "
                f"for {size} bytes; it must return 1-D uint8 of at least {nbytes} elements"
            )
        with self._grow_lock:
            slot.tensor = tensor
            slot.grows += 1

    def _lend(self, slot: _Slot, nbytes: int) -> PinnedBuffer:
        if slot.index in self._lent:  # an invariant: a slot is lent at most once at a time
            raise RuntimeError(f"staging buffer {slot.index} would be handed out twice")
        buffer = PinnedBuffer(self, slot, nbytes)
        self._lent[slot.index] = buffer
        self._acquisitions += 1
        self._peak = max(self._peak, len(self._lent))
        return buffer

    def _put_back(self, slot: _Slot) -> None:
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.slot = slot
            waiter.event.set()
        else:
            self._free.append(slot)

    def _reclaim(self) -> None:
        if not self._parked:
            return
        done = [slot for fence, slot in self._parked if fence.query()]
        if done:
            self._parked = [(f, s) for f, s in self._parked if s not in done]
            for slot in done:
                self._put_back(slot)
