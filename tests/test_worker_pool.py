from __future__ import annotations

import contextvars
import threading

import anyio
import pytest

from aiomm.worker_pool import WorkerPool

pytestmark = pytest.mark.anyio

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_runs_in_named_threads_with_the_callers_context() -> None:
    pool = WorkerPool(2, "aiomm-test")
    VAR.set("caller")
    try:
        name, value = await pool.run(lambda: (threading.current_thread().name, VAR.get()))
    finally:
        pool.shutdown()
    assert name.startswith("aiomm-test")
    assert value == "caller"


async def test_an_exception_reaches_the_caller_and_the_pool_goes_on() -> None:
    pool = WorkerPool(1, "aiomm-test")

    def fail() -> None:
        raise ValueError("bad item")

    try:
        with pytest.raises(ValueError, match="bad item"):
            await pool.run(fail)
        assert await pool.run(lambda x: x + 1, 1) == 2
        assert pool.statistics().in_use == 0
    finally:
        pool.shutdown()


async def test_jobs_queue_beyond_the_threads_and_statistics_count_them() -> None:
    pool = WorkerPool(1, "aiomm-test")
    release = threading.Event()
    started = threading.Event()
    order: list[str] = []

    def job(name: str) -> str:
        started.set()
        release.wait(10)
        order.append(name)
        return name

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, job, "a")
            await anyio.to_thread.run_sync(started.wait, 10)
            tg.start_soon(pool.run, job, "b")
            await anyio.sleep(0.05)
            s = pool.statistics()
            assert (s.capacity, s.in_use, s.waiting) == (1, 1, 1)
            release.set()
        assert order == ["a", "b"]  # one thread: first in, first out
        s = pool.statistics()
        assert (s.in_use, s.waiting) == (0, 0)
    finally:
        pool.shutdown()


async def test_a_cancelled_caller_waits_for_its_running_job() -> None:
    pool = WorkerPool(1, "aiomm-test")
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(10)
        done.set()

    scope = anyio.CancelScope()
    returned: list[bool] = []

    async def caller() -> None:
        with scope:
            await pool.run(job)
        returned.append(done.is_set())

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
            await anyio.sleep(0.05)
            assert returned == []  # still waiting for its job
            release.set()
        assert returned == [True]  # it returned only once the job had ended
        assert pool.statistics().in_use == 0
    finally:
        pool.shutdown()


async def test_a_cancelled_queued_job_never_runs() -> None:
    pool = WorkerPool(1, "aiomm-test")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def blocker() -> None:
        started.set()
        release.wait(10)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, blocker)
            await anyio.to_thread.run_sync(started.wait, 10)
            with anyio.move_on_after(0.05):
                await pool.run(ran.append, "queued")
            assert pool.statistics().waiting == 0  # dropped from the queue
            release.set()
        assert await pool.run(lambda: "after") == "after"
        assert ran == []
    finally:
        pool.shutdown()


async def test_shutdown_joins_the_threads_and_refuses_new_jobs() -> None:
    pool = WorkerPool(2, "aiomm-shutdown")
    await pool.run(lambda: None)
    pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("aiomm-shutdown")]
    with pytest.raises(RuntimeError):
        await pool.run(lambda: None)


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError, match="threads=0"):
        WorkerPool(0, "aiomm-test")
