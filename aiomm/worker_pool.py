"""A fixed set of worker threads fed from one queue, awaited from the event loop.

``anyio.to_thread.run_sync(fn, limiter=...)`` hands a worker its next job only after the
previous job's result has travelled back to the loop and the waiting task has taken the freed
token: two or three loop iterations during which the worker sits idle, behind whatever else the
loop is running. On small images that gap cost a quarter of the throughput (two workers busy
0.56 of a core each). Here jobs wait in the executor's own queue, so a worker that finishes one
starts the next at once; the loop only collects results.

:meth:`WorkerPool.set_limit` lets fewer threads than the pool has run jobs at once (the rest
wait at a gate inside the pool and pass it first come, first served): a server of several
processes on one host keeps each process to its share of the cores while it is busy, and lets
one request alone use them all.
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
import anyio.to_thread

from aiomm import memory
from aiomm.errors import EngineClosedError

__all__ = ("WorkerPool", "WorkerPoolStatistics")

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerPoolStatistics:
    """``capacity`` threads, ``in_use`` of them running a job, ``waiting`` jobs queued (or held
    at the gate of :meth:`WorkerPool.set_limit`), ``limit`` jobs allowed to run at once."""

    capacity: int
    in_use: int
    waiting: int
    limit: int


class _Abandoned(Exception):
    """A job dropped at the gate: its caller was cancelled and never reads it."""


class _Job:
    """One job's flag, set (under the gate's lock) when its caller leaves."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class WorkerPool:
    """``threads`` worker threads named ``name``; :meth:`run` awaits one job.

    Like ``anyio.to_thread.run_sync`` without ``abandon_on_cancel``: a job runs in a copy of
    the caller's context, and a caller cancelled while its job runs waits for the job to end
    (a job queued, or held at the gate of :meth:`set_limit`, is dropped at once). Threads start
    on first use and end at :meth:`aclose`.
    They are not anyio worker threads: a job cannot use ``anyio.from_thread``.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be positive")
        self.capacity = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=memory.mark_thread_arena
        )
        self._closed = False
        # jobs submitted and dropped before they started (the loop's counts), started and
        # running (the workers', under the lock)
        self._submitted = self._dropped = 0
        self._started = self._running = self._abandoned = 0
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)
        self._limit = threads
        # tickets in the order threads take the gate's lock (about the queue's order): the gate
        # lets them through first come, first served
        self._tickets = self._next_ticket = 0

    def set_limit(self, jobs: int) -> None:
        """Run at most ``jobs`` (clamped to 1..``capacity``) jobs at once from now on; a thread
        that takes a job beyond it waits until one ends. Called from the event loop only (the
        one writer), so an unchanged limit is seen without taking the lock."""
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
        job = _Job()
        future = self._executor.submit(self._call, job, contextvars.copy_context(), fn, args)
        self._submitted += 1
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            if future.cancel():  # still queued: it never runs
                self._dropped += 1
                raise
            if not future.done():  # running: wait for it, as anyio does
                self._abandon(job)  # unless it still waits at the gate: then it never runs
                with anyio.CancelScope(shield=True):
                    waiter = asyncio.wrap_future(future)
                    await asyncio.wait([waiter])
                    if not waiter.cancelled():
                        waiter.exception()  # read: the caller is cancelled, not failed
            raise

    def _abandon(self, job: _Job) -> None:
        with self._gate:
            job.abandoned = True
            self._gate.notify_all()

    def _call(
        self, job: _Job, context: contextvars.Context, fn: Callable[..., T], args: tuple
    ) -> T:
        with self._gate:
            ticket = self._tickets
            self._tickets += 1
            while ticket != self._next_ticket or (
                self._running >= self._limit and not job.abandoned
            ):
                self._gate.wait()
            self._next_ticket += 1
            self._gate.notify_all()  # the next ticket may fit too
            if job.abandoned:  # its caller left while it waited: it never runs
                self._abandoned += 1
                raise _Abandoned
            self._started += 1
            self._running += 1
        try:
            return context.run(fn, *args)
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()

    def statistics(self) -> WorkerPoolStatistics:
        with self._lock:
            started, running, limit = self._started, self._running, self._limit
            abandoned = self._abandoned
        queued = max(0, self._submitted - self._dropped - abandoned - started)
        return WorkerPoolStatistics(self.capacity, running, queued, limit)

    async def aclose(self) -> None:
        """Refuse new jobs, let the submitted ones finish and join the threads (off the loop:
        a caller outside the engine's tasks may still have a job running)."""
        self._closed = True
        await anyio.to_thread.run_sync(self._executor.shutdown)
