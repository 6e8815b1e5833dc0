"""A fixed set of worker threads fed from one queue, awaited from the event loop.

``anyio.to_thread.run_sync(fn, limiter=...)`` hands a worker its next job only after the
previous job's result has travelled back to the loop and the waiting task has taken the freed
token: two or three loop iterations during which the worker sits idle, behind whatever else the
loop is running. On small images that gap cost a quarter of the throughput (two workers busy
0.56 of a core each). Here jobs wait in the executor's own queue, so a worker that finishes one
starts the next at once; the loop only collects results.

:meth:`WorkerPool.set_limit` lets fewer threads than the pool has run jobs at once: a server of
several processes on one host keeps each process to its share of the cores while it is busy,
and lets one request alone use them all. A thread takes a job only when the limit lets it run
it, so under a limit the thread that finishes a job goes straight on with the next one; had the
next job been taken by a thread waiting at the limit, every job would be a hand-off between two
threads (one woken, one put to sleep: ~0.015 of a core idle in a 2-worker server on 2 cores).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.to_thread

from aiomm import memory
from aiomm.errors import EngineClosedError

__all__ = ("WorkerPool", "WorkerPoolStatistics")

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerPoolStatistics:
    """``capacity`` threads, ``in_use`` of them running a job, ``waiting`` jobs queued (for a
    thread or for :meth:`WorkerPool.set_limit`'s limit), ``limit`` jobs allowed to run at once."""

    capacity: int
    in_use: int
    waiting: int
    limit: int


#: a queued job: the caller's context, the call and the future its caller awaits
_Entry = tuple[
    contextvars.Context, Callable[..., object], tuple, "concurrent.futures.Future[object]"
]


class WorkerPool:
    """``threads`` worker threads named ``name``; :meth:`run` awaits one job.

    Like ``anyio.to_thread.run_sync`` without ``abandon_on_cancel``: a job runs in a copy of
    the caller's context, and a caller cancelled while its job runs waits for the job to end
    (a job still queued, waiting for a thread or for :meth:`set_limit`'s limit, is dropped at
    once). Threads start on first use and end at :meth:`aclose`.
    They are not anyio worker threads: a job cannot use ``anyio.from_thread``.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be positive")
        self.capacity = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=memory.mark_thread_arena
        )
        self._closed = self._threads_started = False
        # jobs submitted and dropped before they started (the loop's counts), started and
        # running (the workers', under the lock)
        self._submitted = self._dropped = 0
        self._started = self._running = 0
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)
        self._limit = threads
        self._queue: deque[_Entry] = deque()  # first come, first served
        self._idle = 0  # threads waiting for a job they may run

    def set_limit(self, jobs: int) -> None:
        """Run at most ``jobs`` (clamped to 1..``capacity``) jobs at once from now on; a queued
        job beyond it waits until one ends. Called from the event loop only (the one writer),
        so an unchanged limit is seen without taking the lock."""
        jobs = max(1, min(self.capacity, jobs))
        if jobs == self._limit:
            return
        with self._gate:
            self._limit = jobs
            self._gate.notify_all()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread; its result, or its exception.

        :raises EngineClosedError: the pool was closed.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise EngineClosedError("the worker threads are closed: the engine is not open")
        if not self._threads_started:
            self._threads_started = True
            for _ in range(self.capacity):
                self._executor.submit(self._work)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._gate:
            self._queue.append((contextvars.copy_context(), fn, args, future))  # type: ignore[arg-type]
            if self._idle and self._running < self._limit:
                self._gate.notify()
        self._submitted += 1
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            if future.cancel():  # still queued: it never runs
                self._dropped += 1
                raise
            if not future.done():  # running: wait for it, as anyio does
                with anyio.CancelScope(shield=True):
                    waiter = asyncio.wrap_future(future)
                    await asyncio.wait([waiter])
                    if not waiter.cancelled():
                        waiter.exception()  # read: the caller is cancelled, not failed
            raise

    def _work(self) -> None:
        """One thread's life: run queued jobs while the limit allows, until the pool closes
        and its queue is empty."""
        while True:
            with self._gate:
                while not (self._queue and self._running < self._limit):
                    if self._closed and not self._queue:
                        return
                    self._idle += 1
                    try:
                        self._gate.wait()
                    finally:
                        self._idle -= 1
                context, fn, args, future = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # its caller left while it was queued (counted there)
                self._started += 1
                self._running += 1
            result: object = None
            error: BaseException | None = None
            try:
                result = context.run(fn, *args)
            except BaseException as exc:  # the caller's to see, as the executor would
                error = exc
            with self._gate:
                self._running -= 1
                if self._closed and not self._queue:
                    self._gate.notify_all()  # the idle threads end too
                # this thread takes the next job itself; wake another only for more
                elif self._idle and len(self._queue) > 1 and self._running + 1 < self._limit:
                    self._gate.notify()
            # after the count: a caller that reads the statistics once its job returned sees
            # the thread free
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
                del error  # no cycle through the traceback's frame

    def statistics(self) -> WorkerPoolStatistics:
        with self._lock:
            started, running, limit = self._started, self._running, self._limit
        queued = max(0, self._submitted - self._dropped - started)
        return WorkerPoolStatistics(self.capacity, running, queued, limit)

    async def aclose(self) -> None:
        """Refuse new jobs, let the submitted ones finish and join the threads (off the loop:
        a caller outside the engine's tasks may still have a job running)."""
        self._closed = True
        with self._gate:
            self._gate.notify_all()
        await anyio.to_thread.run_sync(self._executor.shutdown)
