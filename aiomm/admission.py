"""Admission control by bytes: a budget of decoded image bytes in flight."""

from __future__ import annotations

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
    Loop-thread only.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be positive")
        self.capacity = capacity
        self._in_use = 0
        self._peak = 0
        self._waiters: list[tuple[int, anyio.Event]] = []

    def _fits(self, n: int) -> bool:
        return self._in_use + n <= self.capacity or self._in_use == 0

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, then take them. Always a checkpoint."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        if not self._waiters and self._fits(n):
            self._take(n)
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return
        event = anyio.Event()
        entry = (n, event)
        self._waiters.append(entry)
        try:
            await event.wait()
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif event.is_set():
                # Granted while being cancelled: hand the bytes back.
                self.release(n)
            raise

    def _take(self, n: int) -> None:
        self._in_use += n
        self._peak = max(self._peak, self._in_use)

    def release(self, n: int) -> None:
        """Return ``n`` bytes and wake the waiters that now fit, in order."""
        self._in_use -= n
        if self._in_use < 0:
            raise RuntimeError("ByteBudget released more than it handed out")
        while self._waiters and self._fits(self._waiters[0][0]):
            n_next, event = self._waiters.pop(0)
            self._take(n_next)
            event.set()

    def statistics(self) -> ByteBudgetStatistics:
        return ByteBudgetStatistics(self.capacity, self._in_use, self._peak, len(self._waiters))
