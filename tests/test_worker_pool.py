from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from aiomm.engine._worker_pool import WorkerPool
from aiomm.errors import EngineClosedError

pytestmark = pytest.mark.anyio

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def pool() -> AsyncIterator[WorkerPool]:
    """One worker thread, closed after the test."""
    pool = WorkerPool(1, "aiomm-test")
    yield pool
    await pool.aclose()


class Gate:
    """A job that holds its worker until :meth:`open`; ``started`` is set once it runs."""

    def __init__(self) -> None:
        self.started, self.released = threading.Event(), threading.Event()

    def hold(self, result: object = None) -> object:
        self.started.set()
        self.released.wait(10)
        return result

    async def wait_started(self) -> None:
        await anyio.to_thread.run_sync(self.started.wait, 10)

    def open(self) -> None:
        self.released.set()


async def test_runs_in_named_threads_with_the_callers_context() -> None:
    pool = WorkerPool(2, "aiomm-test")
    VAR.set("caller")
    try:
        name, value = await pool.run(lambda: (threading.current_thread().name, VAR.get()))
    finally:
        await pool.aclose()
    assert name.startswith("aiomm-test")
    assert value == "caller"


async def test_an_exception_reaches_the_caller_and_the_pool_goes_on(pool: WorkerPool) -> None:

    def fail() -> None:
        raise ValueError("bad item")

    with pytest.raises(ValueError, match="bad item"):
        await pool.run(fail)
    assert await pool.run(lambda x: x + 1, 1) == 2
    assert pool.statistics().in_use == 0


async def test_jobs_queue_beyond_the_threads_and_statistics_count_them(pool: WorkerPool) -> None:
    gate = Gate()
    order: list[str] = []

    def job(name: str) -> None:
        order.append(str(gate.hold(name)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run, job, "a")
        await gate.wait_started()
        tg.start_soon(pool.run, job, "b")
        await anyio.sleep(0.05)
        s = pool.statistics()
        assert (s.capacity, s.in_use, s.waiting) == (1, 1, 1)
        gate.open()
    assert order == ["a", "b"]  # one thread: first in, first out
    s = pool.statistics()
    assert (s.in_use, s.waiting) == (0, 0)


async def test_a_limit_holds_jobs_beyond_it_at_the_gate_until_raised() -> None:
    pool = WorkerPool(3, "aiomm-test")
    gates = [Gate() for _ in range(3)]
    try:
        pool.set_limit(1)
        async with anyio.create_task_group() as tg:
            for gate in gates:
                tg.start_soon(pool.run, gate.hold)
            await gates[0].wait_started()
            await anyio.sleep(0.05)
            # one runs; the others wait (queued or at the gate) and count as waiting
            assert not gates[1].started.is_set() and not gates[2].started.is_set()
            s = pool.statistics()
            assert (s.capacity, s.in_use, s.waiting, s.limit) == (3, 1, 2, 1)
            pool.set_limit(2)  # one more may start at once: the first in line
            await gates[1].wait_started()
            await anyio.sleep(0.05)
            assert not gates[2].started.is_set()
            assert pool.statistics().in_use == 2
            for gate in gates:
                gate.open()
        assert all(g.started.is_set() for g in gates)
        pool.set_limit(99)  # clamped to the threads
        assert pool.statistics().limit == 3
        pool.set_limit(0)
        assert pool.statistics().limit == 1
    finally:
        for gate in gates:
            gate.open()
        await pool.aclose()


async def test_a_cancelled_caller_waits_for_its_running_job(pool: WorkerPool) -> None:
    gate, done = Gate(), threading.Event()

    def job() -> None:
        gate.hold()
        done.set()

    scope = anyio.CancelScope()
    returned: list[bool] = []

    async def caller() -> None:
        with scope:
            await pool.run(job)
        returned.append(done.is_set())

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await gate.wait_started()
        scope.cancel()
        await anyio.sleep(0.05)
        assert returned == []  # still waiting for its job
        gate.open()
    assert returned == [True]  # it returned only once the job had ended
    assert pool.statistics().in_use == 0


async def test_a_cancelled_queued_job_never_runs(pool: WorkerPool) -> None:
    gate = Gate()
    ran: list[str] = []

    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run, gate.hold)
        await gate.wait_started()
        with anyio.move_on_after(0.05):
            await pool.run(ran.append, "queued")
        assert pool.statistics().waiting == 0  # dropped from the queue
        gate.open()
    assert await pool.run(lambda: "after") == "after"
    assert ran == []


async def test_a_job_held_at_the_gate_is_dropped_when_its_caller_leaves() -> None:
    """A job beyond the limit waits in the queue while a thread is free: a cancelled caller
    returns at once and the job never runs; the next caller is served."""
    pool = WorkerPool(2, "aiomm-test")
    gate = Gate()
    ran: list[str] = []
    try:
        pool.set_limit(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, gate.hold)
            await gate.wait_started()
            with anyio.move_on_after(0.1) as scope:
                await pool.run(ran.append, "held")
            assert scope.cancelled_caught  # returned without waiting for the gate to open
            s = pool.statistics()
            assert (s.in_use, s.waiting) == (1, 0)
            gate.open()
        assert await pool.run(lambda: "after") == "after"
        assert ran == []
    finally:
        gate.open()
        await pool.aclose()


async def test_close_lets_submitted_jobs_finish_then_refuses_new_ones() -> None:
    pool = WorkerPool(1, "aiomm-close")
    gate = Gate()
    results: list[object] = []

    async def caller(name: str) -> None:  # a task of its own, as a user's request
        results.append(await pool.run(gate.hold, name))

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, "running")
        await gate.wait_started()
        tg.start_soon(caller, "queued")
        await anyio.sleep(0.05)
        tg.start_soon(pool.aclose)
        await anyio.sleep(0.05)
        gate.open()
    assert sorted(results) == ["queued", "running"]  # neither was lost to the close
    assert not [t for t in threading.enumerate() if t.name.startswith("aiomm-close")]
    with pytest.raises(EngineClosedError):
        await pool.run(lambda: None)


async def test_a_job_failing_after_its_caller_left_logs_nothing(
    pool: WorkerPool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import gc

    gate = Gate()

    def job() -> None:
        gate.hold()
        raise ValueError("corrupt image")

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            await pool.run(job)

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, scope)
        await gate.wait_started()
        scope.cancel()
        await anyio.sleep(0.02)
        gate.open()
    gc.collect()
    await anyio.lowlevel.checkpoint()
    assert "never retrieved" not in caplog.text


async def test_under_a_limit_the_thread_that_ends_a_job_runs_the_next() -> None:
    """Two threads, a limit of one: jobs queued behind a running one all run on its thread,
    none handed to the other (a wake-up and a sleep per job, and an idle core between)."""
    pool = WorkerPool(2, "aiomm-test")
    gate = Gate()
    threads: list[str] = []

    def job() -> None:
        threads.append(threading.current_thread().name)

    def first() -> None:
        job()
        gate.hold()

    try:
        pool.set_limit(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, first)
            await gate.wait_started()
            for _ in range(5):
                tg.start_soon(pool.run, job)
            await anyio.sleep(0.05)
            assert pool.statistics().waiting == 5
            gate.open()
        assert len(threads) == 6 and set(threads) == {threads[0]}
        pool.set_limit(2)  # both threads run again when the limit allows it
        gates = [Gate(), Gate()]
        async with anyio.create_task_group() as tg:
            for g in gates:
                tg.start_soon(pool.run, g.hold)
            for g in gates:
                await g.wait_started()  # both at once: the second thread was woken
            for g in gates:
                g.open()
    finally:
        gate.open()
        await pool.aclose()


async def test_a_job_that_returned_is_no_longer_counted_as_running(pool: WorkerPool) -> None:
    """Its caller, resumed, reads the statistics: the thread is already free."""
    for _ in range(50):
        await pool.run(lambda: None)
        assert pool.statistics().in_use == 0
    with pytest.raises(ValueError):
        await pool.run(int, "x")
    assert pool.statistics().in_use == 0


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError, match="threads=0"):
        WorkerPool(0, "aiomm-test")


async def test_busy_seconds_count_the_jobs_run_time(pool: WorkerPool) -> None:
    assert pool.statistics().busy_seconds == 0.0
    await pool.run(time.sleep, 0.2)
    await pool.run(time.sleep, 0.1)
    busy = pool.statistics().busy_seconds
    assert 0.3 <= busy < 1.0
    await anyio.sleep(0.2)  # idle time is not counted
    assert pool.statistics().busy_seconds == busy
