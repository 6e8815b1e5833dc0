"""The admission stage: at most ``max_in_flight`` requests inside the pipeline at once.

Input: a request about to be processed. Output: a slot held while it is processed (an async
context manager). Runs on the event loop. Counts every request by how it ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from ._stage import Stage, StageStatistics

__all__ = ("AdmissionStage", "AdmissionStatistics")


@dataclass(frozen=True)
class AdmissionStatistics:
    """Requests by outcome; ``queue`` is the admission limiter."""

    started: int
    completed: int
    failed: int
    cancelled: int
    queue: StageStatistics


class AdmissionStage(Stage):
    """Bounds the requests in flight and counts how each ended."""

    name = "admission"

    def __init__(self, max_in_flight: int) -> None:
        super().__init__(max_in_flight)
        self._started = 0
        self._cancelled = 0

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one slot for the enclosed request (waiting for one first)."""
        assert self.limiter is not None
        self._started += 1
        try:
            async with self.limiter:
                with self.counted():
                    yield
        except anyio.get_cancelled_exc_class():
            self._cancelled += 1
            raise

    def request_statistics(self) -> AdmissionStatistics:
        queue = self.statistics()
        return AdmissionStatistics(
            started=self._started,
            completed=queue.completed,
            failed=queue.failed,
            cancelled=self._cancelled,
            queue=queue,
        )
