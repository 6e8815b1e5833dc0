"""What every stage shares: a bounded limiter, counts of calls, and a frozen statistics record."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import anyio

__all__ = ("Stage", "StageStatistics")


@dataclass(frozen=True)
class StageStatistics:
    """A snapshot of one stage: its bound (0 when it has none), use, waiters and outcomes.

    ``limit`` is how many of its ``capacity`` slots may be in use now: the capacity, except
    for the transform stage while ``EngineConfig.busy_transform_threads`` holds its threads
    back (two or more requests in flight)."""

    name: str
    capacity: int
    in_use: int
    waiting: int
    completed: int
    failed: int
    limit: int


class Stage:
    """Base of the stages: ``limiter`` bounds the stage's concurrent work (None: unbounded
    loop work that never blocks), :meth:`counted` counts each call's outcome."""

    name: str = "stage"

    def __init__(self, capacity: int | None) -> None:
        self.limiter: anyio.CapacityLimiter | None = (
            None if capacity is None else anyio.CapacityLimiter(capacity)
        )
        self._completed = 0
        self._failed = 0

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Count the enclosed call as completed, or failed when it raises an ``Exception``
        (a cancellation is neither)."""
        try:
            yield
        except Exception:
            self._failed += 1
            raise
        self._completed += 1

    def statistics(self) -> StageStatistics:
        if self.limiter is None:
            capacity = in_use = waiting = 0
        else:
            s = self.limiter.statistics()
            capacity, in_use, waiting = int(s.total_tokens), s.borrowed_tokens, s.tasks_waiting
        return StageStatistics(
            self.name, capacity, in_use, waiting, self._completed, self._failed, capacity
        )
