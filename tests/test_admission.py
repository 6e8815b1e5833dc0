"""ByteBudget: admission by decoded bytes in flight."""

from __future__ import annotations

import anyio
import pytest

from aiomm.engine._byte_budget import ByteBudget


async def test_waits_until_bytes_fit_and_serves_in_order() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "big", 70)
        await anyio.sleep(0.01)
        tg.start_soon(take, "small", 10)  # fits now, but must not overtake the earlier waiter
        await anyio.sleep(0.01)
        assert order == [] and budget.statistics().waiting == 2
        budget.release(60)
    assert order == ["big", "small"]
    stats = budget.statistics()
    assert stats.in_use == 80 and stats.peak == 80 and stats.waiting == 0


async def test_item_larger_than_budget_is_admitted_alone() -> None:
    budget = ByteBudget(100)
    await budget.acquire(10)
    admitted = anyio.Event()

    async def huge() -> None:
        await budget.acquire(500)
        admitted.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(huge)
        await anyio.sleep(0.01)
        assert not admitted.is_set()
        budget.release(10)
        await admitted.wait()
    assert budget.statistics().in_use == 500


async def test_cancelled_waiter_takes_nothing() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    with anyio.move_on_after(0.02):
        await budget.acquire(50)
    assert budget.statistics().waiting == 0
    budget.release(100)
    assert budget.statistics().in_use == 0
    await budget.acquire(100)  # the whole budget is available again


def test_release_more_than_taken_is_an_error() -> None:
    budget = ByteBudget(10)
    with pytest.raises(RuntimeError):
        budget.release(1)
    with pytest.raises(ValueError):
        ByteBudget(0)


async def test_try_take_from_a_worker_thread_never_overtakes_a_waiter() -> None:
    budget = ByteBudget(100)
    assert await anyio.to_thread.run_sync(budget.try_take, 60)  # a worker admits its own item
    assert not await anyio.to_thread.run_sync(budget.try_take, 50)  # does not fit: nothing taken
    assert budget.statistics().in_use == 60
    order: list[str] = []

    async def wait_for(n: int) -> None:
        await budget.acquire(n)
        order.append("waiter")

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for, 70)
        await anyio.sleep(0.01)
        # 10 bytes fit, but a waiter is queued: the worker goes back to the loop instead
        assert not await anyio.to_thread.run_sync(budget.try_take, 10)
        budget.release(60)  # the loop's release wakes the waiter
    assert order == ["waiter"]
    assert budget.try_take(30) and budget.statistics().in_use == 100


async def test_try_take_admits_an_item_larger_than_the_budget_alone() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(500)  # nothing in use: admitted alone, as acquire does
    assert not budget.try_take(1)
    budget.release(500)
    assert budget.statistics().in_use == 0
