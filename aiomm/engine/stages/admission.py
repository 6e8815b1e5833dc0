"""The admission stage: at most ``max_in_flight`` requests inside the pipeline at once, and at
most ``max_waiting`` waiting for a slot; a request beyond both is shed with OverloadedError.

Requests with a network URL take a slot of their own lane first (``network_slots``, fewer than
``max_in_flight``): slow downloads can fill that lane, never every slot, so requests carrying
their images inline keep being admitted under a slow-loris flood. Each lane sheds by its own
waiters, so network requests queueing for their lane never push inline ones out.

Input: a request about to be processed. Output: a slot held while it is processed (an async
context manager). Runs on the event loop. Counts every request by how it ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from aiomm.errors import OverloadedError

from ._stage import Stage, StageStatistics

__all__ = ("AdmissionStage", "AdmissionStatistics")


@dataclass(frozen=True)
class AdmissionStatistics:
    """Requests by outcome; ``queue`` is the admission limiter."""

    started: int
    completed: int
    failed: int
    cancelled: int
    #: refused at once with OverloadedError (not counted in ``started``)
    shed: int
    #: the bound on waiting requests (per lane)
    max_waiting: int
    queue: StageStatistics
    #: the lane of requests with a network URL
    network: StageStatistics


class AdmissionStage(Stage):
    """Bounds the requests in flight and counts how each ended."""

    name = "admission"

    def __init__(self, max_in_flight: int, max_waiting: int, network_slots: int) -> None:
        super().__init__(max_in_flight)
        self.max_waiting = max_waiting
        self._network = _Lane(network_slots)
        self._started = 0
        self._cancelled = 0
        self._shed = 0

    @contextlib.asynccontextmanager
    async def admit(self, *, network: bool = False) -> AsyncIterator[None]:
        """Hold one slot for the enclosed request (waiting for one first); ``network``: the
        request fetches from the network, and takes a slot of the network lane first.

        :raises OverloadedError: the slots it needs are taken and ``max_waiting`` requests wait
            for them already.
        """
        limiter = self.limiter
        assert limiter is not None
        self._shed_if_full(self._network.limiter if network else limiter)
        self._started += 1
        try:
            if network:
                async with self._network.limiter, limiter:
                    with self.counted():
                        yield
            else:
                async with limiter:
                    with self.counted():
                        yield
        except anyio.get_cancelled_exc_class():
            self._cancelled += 1
            raise

    def _shed_if_full(self, limiter: anyio.CapacityLimiter) -> None:
        if limiter.available_tokens > 0:  # a slot is free: it cannot be full (the cheap check)
            return
        s = limiter.statistics()
        if s.borrowed_tokens >= s.total_tokens and s.tasks_waiting >= self.max_waiting:
            self._shed += 1
            raise OverloadedError(s.tasks_waiting, s.borrowed_tokens)

    def request_statistics(self) -> AdmissionStatistics:
        queue = self.statistics()
        return AdmissionStatistics(
            started=self._started,
            completed=queue.completed,
            failed=queue.failed,
            cancelled=self._cancelled,
            shed=self._shed,
            max_waiting=self.max_waiting,
            queue=queue,
            network=self._network.statistics(),
        )


class _Lane(Stage):
    name = "admission.network"
    #: built with a capacity (``network_slots``), so always bounded
    limiter: anyio.CapacityLimiter
