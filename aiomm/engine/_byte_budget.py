"""Admission control by bytes: a budget of decoded image bytes in flight."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import anyio

__all__ = ("ByteBudget", "ByteBudgetStatistics")


@dataclass(frozen=True)
class ByteBudgetStatistics:
    capacity: int
    in_use: int
    peak: int
    waiting: int


class ByteBudget:
    """Bounds the bytes held by admitted work; ``acquire(n)`` waits until ``n`` fits.

    Counting requests alone lets a few huge images exhaust memory before any stage pushes back
    (SGLang #33035), so decoded sizes are admitted here before the decode starts. A request
    larger than the whole budget is admitted alone once nothing else is in use, so it can never
    starve. Waiters are served in arrival order (FIFO), so small items cannot starve a big one.
    ``acquire`` and ``release`` belong to the event loop's thread; :meth:`try_take` may be
    called from any thread (a worker admits its own item without a trip back to the loop).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be positive")
        self.capacity = capacity
        self._in_use = 0
        self._peak = 0
        self._waiters: list[tuple[int, anyio.Event]] = []
        # try_take runs in worker threads: the count and the waiters' order change under it
        self._lock = threading.Lock()

    def _fits(self, n: int) -> bool:
        return self._in_use + n <= self.capacity or self._in_use == 0

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, then take them. Always a checkpoint."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        with self._lock:
            if not self._waiters and self._fits(n):
                self._take(n)
                entry = None
            else:
                entry = (n, anyio.Event())
                self._waiters.append(entry)
        if entry is None:
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return
        event = entry[1]
        try:
            await event.wait()
        except BaseException:
            with self._lock:
                waiting = entry in self._waiters
                if waiting:
                    self._waiters.remove(entry)
            if not waiting and event.is_set():
                # Granted while being cancelled: hand the bytes back.
                self.release(n)
            raise

    def try_take(self, n: int) -> bool:
        """Take ``n`` bytes now if they fit and nobody waits (FIFO kept); never blocks, any
        thread. The taker hands them back with :meth:`release` on the loop's thread."""
        with self._lock:
            if self._waiters or not self._fits(n):
                return False
            self._take(n)
            return True

    def _take(self, n: int) -> None:
        self._in_use += n
        self._peak = max(self._peak, self._in_use)

    def release(self, n: int) -> None:
        """Return ``n`` bytes and wake the waiters that now fit, in order."""
        woken = []
        with self._lock:
            if self._in_use - n < 0:
                raise RuntimeError("ByteBudget released more than it handed out")
            self._in_use -= n
            while self._waiters and self._fits(self._waiters[0][0]):
                n_next, event = self._waiters.pop(0)
                self._take(n_next)
                woken.append(event)
        for event in woken:
            event.set()

    def statistics(self) -> ByteBudgetStatistics:
        with self._lock:
            return ByteBudgetStatistics(self.capacity, self._in_use, self._peak, len(self._waiters))
