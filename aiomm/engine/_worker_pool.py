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

The threads are daemon threads that hold the pool's shared state, never the pool: a host that
never closes its engine (a crash path, a forgotten ``aclose``) still exits, where
``concurrent.futures``' exit hook would join idle workers forever, and a pool dropped unclosed
ends its idle threads when it is collected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.to_thread

from aiomm.errors import EngineClosedError
from aiomm.tuning import malloc as memory

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
    #: seconds the threads spent running jobs, summed over threads, since the pool started
    busy_seconds: float = 0.0


#: a queued job: the caller's context, the call and the future its caller awaits
_Entry = tuple[
    contextvars.Context, Callable[..., object], tuple, "concurrent.futures.Future[object]"
]


class _Shared:
    """What the pool and its threads share. The threads hold this, not the pool, so a pool
    nobody closed can still be collected, which closes it."""

    def __init__(self, threads: int) -> None:
        self.lock = threading.Lock()
        self.gate = threading.Condition(self.lock)
        self.limit = threads
        self.queue: deque[_Entry] = deque()  # first come, first served
        self.idle = 0  # threads waiting for a job they may run
        self.closed = False
        # jobs started and running (the workers' counts, under the lock)
        self.started = self.running = 0
        self.busy_seconds = 0.0  # jobs' run time, summed over threads (under the lock)

    def close(self) -> None:
        """Refuse nothing (the pool does that) but let every thread end once the queue is
        empty."""
        with self.gate:
            self.closed = True
            self.gate.notify_all()

    def work(self) -> None:
        """One thread's life: run queued jobs while the limit allows, until the pool closes
        and its queue is empty."""
        memory.mark_thread_arena()
        gate = self.gate
        while True:
            with gate:
                while not (self.queue and self.running < self.limit):
                    if self.closed and not self.queue:
                        return
                    self.idle += 1
                    try:
                        gate.wait()
                    finally:
                        self.idle -= 1
                context, fn, args, future = self.queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # its caller left while it was queued (counted there)
                self.started += 1
                self.running += 1
            result: object = None
            error: BaseException | None = None
            began = time.perf_counter()
            try:
                result = context.run(fn, *args)
            except BaseException as exc:  # the caller's to see, as an executor would
                error = exc
            with gate:
                self.busy_seconds += time.perf_counter() - began
                self.running -= 1
                if self.closed and not self.queue:
                    gate.notify_all()  # the idle threads end too
                # this thread takes the next job itself; wake another only for more
                elif self.idle and len(self.queue) > 1 and self.running + 1 < self.limit:
                    gate.notify()
            # after the count: a caller that reads the statistics once its job returned sees
            # the thread free
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
                del error  # no cycle through the traceback's frame
            del context, fn, args, future, result  # hold nothing of a job while idle


class WorkerPool:
    """``threads`` worker threads named ``name``; :meth:`run` awaits one job.

    Like ``anyio.to_thread.run_sync`` without ``abandon_on_cancel``: a job runs in a copy of
    the caller's context, and a caller cancelled while its job runs waits for the job to end
    (a job still queued, waiting for a thread or for :meth:`set_limit`'s limit, is dropped at
    once). Threads start on first use and end at :meth:`aclose`, when the pool is collected,
    or with the process (they never keep it alive).
    They are not anyio worker threads: a job cannot use ``anyio.from_thread``.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be positive")
        self.capacity = threads
        self.name = name
        self._shared = _Shared(threads)
        self._threads: list[threading.Thread] = []
        self._closed = False
        # jobs submitted and dropped before they started (the loop's counts)
        self._submitted = self._dropped = 0
        weakref.finalize(self, self._shared.close)

    def set_limit(self, jobs: int) -> None:
        """Run at most ``jobs`` (clamped to 1..``capacity``) jobs at once from now on; a queued
        job beyond it waits until one ends. Called from the event loop only (the one writer),
        so an unchanged limit is seen without taking the lock."""
        jobs = max(1, min(self.capacity, jobs))
        shared = self._shared
        if jobs == shared.limit:
            return
        with shared.gate:
            shared.limit = jobs
            shared.gate.notify_all()

    def _start_threads(self) -> None:
        for i in range(self.capacity):
            thread = threading.Thread(
                target=self._shared.work, name=f"{self.name}_{i}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread; its result, or its exception.

        :raises EngineClosedError: the pool was closed.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise EngineClosedError("the worker threads are closed: the engine is not open")
        if not self._threads:
            self._start_threads()
        shared = self._shared
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with shared.gate:
            shared.queue.append((contextvars.copy_context(), fn, args, future))  # type: ignore[arg-type]
            if shared.idle and shared.running < shared.limit:
                shared.gate.notify()
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

    def statistics(self) -> WorkerPoolStatistics:
        shared = self._shared
        with shared.lock:
            started, running, limit = shared.started, shared.running, shared.limit
            busy = shared.busy_seconds
        queued = max(0, self._submitted - self._dropped - started)
        return WorkerPoolStatistics(self.capacity, running, queued, limit, busy)

    async def aclose(self) -> None:
        """Refuse new jobs, let the submitted ones finish and join the threads (off the loop:
        a caller outside the engine's tasks may still have a job running)."""
        self._closed = True
        self._shared.close()
        threads, self._threads = self._threads, []
        if threads:
            await anyio.to_thread.run_sync(_join, threads)


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()
