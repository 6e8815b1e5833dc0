"""SingleFlight: one computation per key, detachable waiters, generations."""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable

import anyio
import pytest
import structlog

from aiomm.cache._singleflight import SingleFlight, SingleFlightStatistics
from aiomm.errors import EngineClosedError

pytestmark = pytest.mark.timeout(20)


class Compute:
    """A computation that blocks until released and counts its calls and completions."""

    def __init__(self, result: object = None, error: Exception | None = None) -> None:
        self.result = object() if result is None else result
        self.error = error
        self.release = anyio.Event()
        self.calls = 0
        self.finished = 0
        self.cancelled = 0

    async def __call__(self) -> object:
        self.calls += 1
        try:
            await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        self.finished += 1
        if self.error is not None:
            raise self.error
        return self.result


class Store:
    def __init__(self) -> None:
        self.stored: list[object] = []

    async def __call__(self, value: object) -> None:
        self.stored.append(value)


def spawn(
    tg: anyio.abc.TaskGroup, fn: Callable[[], Awaitable[object]], into: list[object]
) -> anyio.CancelScope:
    """Run ``fn`` in its own cancel scope; its result or exception is appended to ``into``."""
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            try:
                into.append(await fn())
            except Exception as exc:
                into.append(exc)
            except anyio.get_cancelled_exc_class():
                into.append("cancelled")
                raise

    tg.start_soon(run)
    return scope


async def test_concurrent_callers_share_one_computation() -> None:
    compute = Compute()
    results: list[object] = []
    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        async with anyio.create_task_group() as callers:
            for _ in range(50):
                spawn(callers, lambda: flight.do("k", compute), results)
            await anyio.wait_all_tasks_blocked()
            stats = flight.statistics()
            assert (stats.in_flight, stats.waiters, stats.started, stats.joins) == (1, 50, 1, 49)
            compute.release.set()

    assert compute.calls == 1
    assert len(results) == 50
    assert all(value is compute.result for value, _ in results)  # type: ignore[misc]
    assert sorted(joined for _, joined in results) == [False] + [True] * 49  # type: ignore[misc]
    assert flight.statistics() == SingleFlightStatistics(
        in_flight=0, waiters=0, started=1, joins=49, failures=0, generation=0
    )


async def test_cancelling_the_first_caller_only_detaches_it() -> None:
    compute = Compute()
    store = Store()
    first: list[object] = []
    others: list[object] = []
    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        async with anyio.create_task_group() as callers:
            leader = spawn(callers, lambda: flight.do("k", compute, store=store), first)
            await anyio.wait_all_tasks_blocked()
            for _ in range(5):
                spawn(callers, lambda: flight.do("k", compute), others)
            await anyio.wait_all_tasks_blocked()
            leader.cancel()
            await anyio.wait_all_tasks_blocked()
            assert first == ["cancelled"]
            assert flight.statistics().waiters == 5
            compute.release.set()

    assert (compute.calls, compute.finished, compute.cancelled) == (1, 1, 0)
    assert others == [(compute.result, True)] * 5
    assert store.stored == [compute.result]  # the leader's store still runs


async def test_computation_finishes_and_stores_after_every_waiter_detached() -> None:
    compute = Compute()
    store = Store()
    results: list[object] = []
    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        async with anyio.create_task_group() as callers:
            scopes = [spawn(callers, lambda: flight.do("k", compute, store=store), results)]
            scopes += [spawn(callers, lambda: flight.do("k", compute), results) for _ in range(3)]
            await anyio.wait_all_tasks_blocked()
            for scope in scopes:
                scope.cancel()
        assert results == ["cancelled"] * 4
        assert flight.statistics().in_flight == 1
        compute.release.set()
    assert store.stored == [compute.result]
    assert flight.statistics().in_flight == 0


async def test_exception_reaches_every_waiter_and_is_not_cached() -> None:
    error = ValueError("corrupt image")
    failing = Compute(error=error)
    results: list[object] = []
    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        store = Store()
        async with anyio.create_task_group() as callers:
            for _ in range(10):
                spawn(callers, lambda: flight.do("k", failing, store=store), results)
            await anyio.wait_all_tasks_blocked()
            failing.release.set()
        assert len(results) == 10
        assert all(isinstance(r, ValueError) and str(r) == "corrupt image" for r in results)
        assert store.stored == []
        assert flight.statistics().failures == 1

        # The engine task group survived; the next call recomputes.
        retry = Compute()
        retry.release.set()
        assert await flight.do("k", retry) == (retry.result, False)
        assert failing.calls == 1 and retry.calls == 1


async def test_waiter_tracebacks_do_not_accumulate() -> None:
    failing = Compute(error=KeyError("x"))
    depths: list[int] = []

    async def wait() -> None:
        try:
            await flight.do("k", failing)
        except KeyError as exc:
            # Measured at once: the exception object is shared with the other waiters.
            depths.append(len(traceback.extract_tb(exc.__traceback__)))

    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        async with anyio.create_task_group() as callers:
            for _ in range(4):
                callers.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            failing.release.set()
    assert len(depths) == 4 and len(set(depths)) == 1


async def test_different_keys_run_concurrently() -> None:
    started = {"a": anyio.Event(), "b": anyio.Event()}

    def make(key: str, other: str) -> Callable[[], Awaitable[str]]:
        async def compute() -> str:
            started[key].set()
            await started[other].wait()  # deadlocks if the keys were serialised
            return key

        return compute

    results: list[object] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as engine_tg:
            flight = SingleFlight(engine_tg)
            async with anyio.create_task_group() as callers:
                spawn(callers, lambda: flight.do("a", make("a", "b")), results)
                spawn(callers, lambda: flight.do("b", make("b", "a")), results)
    assert sorted(results) == [("a", False), ("b", False)]  # type: ignore[type-var]
    assert flight.statistics().started == 2


async def test_invalidate_during_flight_skips_store_and_forgets_the_flight() -> None:
    stale = Compute()
    fresh = Compute()
    store = Store()
    results: list[object] = []
    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        async with anyio.create_task_group() as callers:
            spawn(callers, lambda: flight.do("k", stale, store=store), results)
            await anyio.wait_all_tasks_blocked()
            flight.invalidate()
            assert flight.generation == 1
            # A caller after the invalidation starts its own computation instead of joining.
            spawn(callers, lambda: flight.do("k", fresh, store=store), results)
            await anyio.wait_all_tasks_blocked()
            stale.release.set()
            fresh.release.set()
    assert (stale.calls, fresh.calls) == (1, 1)
    assert {(id(value), joined) for value, joined in results} == {  # type: ignore[misc]
        (id(stale.result), False),
        (id(fresh.result), False),
    }
    assert store.stored == [fresh.result]


async def test_store_failure_is_logged_and_the_result_still_served() -> None:
    async def broken_store(value: object) -> None:
        raise ConnectionError("redis down")

    async def compute() -> str:
        return "value"

    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        with structlog.testing.capture_logs() as logs:
            assert await flight.do("k", compute, store=broken_store) == ("value", False)
    assert [e["event"] for e in logs] == ["singleflight_store_failed"]


async def test_closing_the_task_group_wakes_waiters_with_engine_closed() -> None:
    compute = Compute()
    results: list[object] = []
    async with anyio.create_task_group() as outer:
        async with anyio.create_task_group() as engine_tg:
            flight = SingleFlight(engine_tg)
            for _ in range(3):
                spawn(outer, lambda: flight.do("k", compute), results)
            await anyio.wait_all_tasks_blocked()
            engine_tg.cancel_scope.cancel()
    assert compute.cancelled == 1
    assert len(results) == 3 and all(isinstance(r, EngineClosedError) for r in results)
    assert flight.statistics().in_flight == 0


async def test_no_tasks_outlive_the_task_group_and_a_closed_group_refuses_work() -> None:
    computes = [Compute() for _ in range(5)]
    async with anyio.create_task_group() as engine_tg:
        flight = SingleFlight(engine_tg)
        async with anyio.create_task_group() as callers:
            for i, compute in enumerate(computes):
                spawn(callers, lambda i=i, c=compute: flight.do(str(i), c), [])
            await anyio.wait_all_tasks_blocked()
            assert flight.statistics().in_flight == 5
            for compute in computes:
                compute.release.set()
    assert all(c.finished == 1 for c in computes)
    stats = flight.statistics()
    assert (stats.in_flight, stats.waiters, stats.started) == (0, 0, 5)

    with pytest.raises(RuntimeError):
        await flight.do("late", Compute())
    assert flight.statistics().started == 5
