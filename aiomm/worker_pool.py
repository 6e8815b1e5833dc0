"""A fixed set of worker threads fed from one queue, awaited from the event loop.

``anyio.to_thread.run_sync(fn, limiter=...)`` hands a worker its next job only after the
previous job's result has travelled back to the loop and the waiting task has taken the freed
token: two or three loop iterations during which the worker sits idle, behind whatever else the
loop is running. On small images that gap cost a quarter of the throughput (two workers busy
0.56 of a core each). Here jobs wait in the executor's own queue, so a worker that finishes one
starts the next at once; the loop only collects results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

__all__ = ("WorkerPool", "WorkerPoolStatistics")

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerPoolStatistics:
    """``capacity`` threads, ``in_use`` of them running a job, ``waiting`` jobs queued."""

    capacity: int
    in_use: int
    waiting: int


class WorkerPool:
    """``threads`` worker threads named ``name``; :meth:`run` awaits one job.

    Like ``anyio.to_thread.run_sync`` without ``abandon_on_cancel``: a job runs in a copy of
    the caller's context, and a caller cancelled while its job runs waits for the job to end
    (a queued job is dropped at once). Threads start on first use and end at :meth:`shutdown`.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be positive")
        self.capacity = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        # the loop counts jobs submitted, dropped before they started, and seen to end; the
        # workers count jobs started (under the lock)
        self._submitted = self._dropped = self._ended = 0
        self._started = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread; its result, or its exception.

        :raises RuntimeError: the pool was shut down.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        future = self._executor.submit(self._call, contextvars.copy_context(), fn, args)
        self._submitted += 1
        try:
            result = await asyncio.wrap_future(future)
        except BaseException:
            if future.cancel():  # still queued: it never runs
                self._dropped += 1
                raise
            if not future.done():  # running: wait for it, as anyio does
                with anyio.CancelScope(shield=True):
                    await asyncio.wait([asyncio.wrap_future(future)])
            self._ended += 1
            raise
        self._ended += 1
        return result

    def _call(self, context: contextvars.Context, fn: Callable[..., T], args: tuple) -> T:
        with self._lock:
            self._started += 1
        return context.run(fn, *args)

    def statistics(self) -> WorkerPoolStatistics:
        with self._lock:
            started = self._started
        running = max(0, started - self._ended)
        queued = max(0, self._submitted - self._dropped - started)
        return WorkerPoolStatistics(self.capacity, min(running, self.capacity), queued)

    def shutdown(self) -> None:
        """Drop queued jobs and join the threads (after the callers' tasks have ended, they
        are idle)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
