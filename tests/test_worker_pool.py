from __future__ import annotations

import contextvars
import threading

import anyio
import pytest

from aiomm.errors import EngineClosedError
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
        await pool.aclose()
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
        await pool.aclose()


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
        await pool.aclose()


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
        await pool.aclose()


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
        await pool.aclose()


async def test_close_lets_submitted_jobs_finish_then_refuses_new_ones() -> None:
    pool = WorkerPool(1, "aiomm-close")
    started, release = threading.Event(), threading.Event()
    results: list[str] = []

    def job(name: str) -> str:
        started.set()
        release.wait(10)
        return name

    async def caller(name: str) -> None:  # a task of its own, as a user's request
        results.append(await pool.run(job, name))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, "running")
        await anyio.to_thread.run_sync(started.wait, 10)
        tg.start_soon(caller, "queued")
        await anyio.sleep(0.05)
        tg.start_soon(pool.aclose)
        await anyio.sleep(0.05)
        release.set()
    assert sorted(results) == ["queued", "running"]  # neither was lost to the close
    assert not [t for t in threading.enumerate() if t.name.startswith("aiomm-close")]
    with pytest.raises(EngineClosedError):
        await pool.run(lambda: None)


async def test_a_job_failing_after_its_caller_left_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import gc

    pool = WorkerPool(1, "aiomm-test")
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(10)
        raise ValueError("corrupt image")

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            await pool.run(job)

    try:
        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, scope)
            await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
            await anyio.sleep(0.02)
            release.set()
        gc.collect()
        await anyio.lowlevel.checkpoint()
    finally:
        await pool.aclose()
    assert "never retrieved" not in caplog.text


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError, match="threads=0"):
        WorkerPool(0, "aiomm-test")
