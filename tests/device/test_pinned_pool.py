"""PinnedBufferPool accounting on the CPU: an injected allocator and manual "copy done" fences.

A :class:`ManualFence` stands in for the CUDA event recorded after a copy, so a test can hold a
copy "in flight" and check that its buffer is not reused until the fence completes, and that every
buffer comes back after errors and cancellation, in FIFO order, never handed out twice.
"""

from __future__ import annotations

import random
import threading

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import torch

from aiomm.device.pinned_pool import CudaEventFence, PinnedBuffer, PinnedBufferPool


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ManualFence:
    """A copy "in flight" until :meth:`complete`."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    def query(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()

    def complete(self) -> None:
        self.event.set()


class Allocator:
    """Ordinary (unpinned) tensors; records every size asked for."""

    def __init__(self, fail: int = 0) -> None:
        self.sizes: list[int] = []
        self.fail = fail

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.fail:
            self.fail -= 1
            raise MemoryError(f"cannot allocate {nbytes} bytes")
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def make_pool(n: int = 2, **kw: object) -> tuple[PinnedBufferPool, Allocator]:
    alloc = kw.pop("allocator", None) or Allocator()
    kw.setdefault("buffer_bytes", 64)
    kw.setdefault("max_buffer_bytes", 1024)
    return PinnedBufferPool(n, allocator=alloc, **kw), alloc  # type: ignore[arg-type]


async def settle() -> None:
    await anyio.wait_all_tasks_blocked()


async def test_acquire_release_occupancy_and_growth() -> None:
    pool, alloc = make_pool(2)
    s = pool.statistics()
    assert (s.capacity, s.allocated, s.in_use, s.total_bytes, s.pinned) == (2, 0, 0, 0, False)
    a = await pool.acquire(10)
    assert a.tensor.numel() == 10 and a.tensor.dtype == torch.uint8
    b = await pool.acquire(100)
    assert a.index != b.index
    assert alloc.sizes == [64, 128]  # at least buffer_bytes, grown to the next power of two
    s = pool.statistics()
    assert (s.in_use, s.allocated, s.total_bytes, s.peak_in_use, s.grows) == (2, 2, 192, 2, 2)
    assert s.max_total_bytes == 2 * 1024
    pool.release(a)
    pool.release(b)
    s = pool.statistics()
    assert (s.in_use, s.waiting, s.in_flight, s.acquisitions) == (0, 0, 0, 2)
    # Best fit: 100 bytes go to the 128-byte slot, 10 to the 64-byte one; nothing reallocated.
    c, d = await pool.acquire(100), await pool.acquire(10)
    assert (c.index, d.index) == (b.index, a.index)
    assert alloc.sizes == [64, 128]


async def test_view_and_use_after_release() -> None:
    pool, _ = make_pool(1)
    buf = await pool.acquire(24)
    v = buf.view(torch.float32, (2, 3))
    assert v.shape == (2, 3) and v.dtype == torch.float32
    with pytest.raises(ValueError, match="needs 32 bytes"):
        buf.view(torch.float32, (8,))
    pool.release(buf)
    assert buf.released
    with pytest.raises(RuntimeError, match="released"):
        buf.tensor  # noqa: B018
    with pytest.raises(RuntimeError, match="not lent by this pool"):
        pool.release(buf)
    other, _ = make_pool(1)
    foreign = await other.acquire(8)
    with pytest.raises(RuntimeError, match="not lent by this pool"):
        pool.release(foreign)


async def test_full_pool_makes_acquire_wait() -> None:
    pool, _ = make_pool(1)
    held = await pool.acquire(8)
    got: list[PinnedBuffer] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_append, pool, got, 8)
        await settle()
        assert not got and pool.statistics().waiting == 1
        with pytest.raises(anyio.WouldBlock):
            pool.acquire_nowait(8)
        pool.release(held)
    assert [b.index for b in got] == [held.index]
    assert pool.statistics().in_use == 1


async def _append(pool: PinnedBufferPool, got: list[PinnedBuffer], nbytes: int) -> None:
    got.append(await pool.acquire(nbytes))


async def test_waiters_are_served_in_order() -> None:
    pool, _ = make_pool(1)
    held = await pool.acquire(8)
    order: list[int] = []

    async def worker(i: int) -> None:
        async with pool.lease(8 * (i + 1)):
            order.append(i)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(worker, i)
            await settle()  # queued in start order
        assert pool.statistics().waiting == 6
        # A newcomer does not jump the queue even when a slot frees up.
        pool.release(held)
        with pytest.raises(anyio.WouldBlock):
            pool.acquire_nowait(8)
    assert order == list(range(6))
    assert pool.statistics().in_use == 0


async def test_buffer_is_not_reused_while_its_copy_is_in_flight() -> None:
    pool, _ = make_pool(1)
    fence = ManualFence()
    released = anyio.Event()
    got: list[PinnedBuffer] = []

    async def copier() -> None:
        async with pool.lease(16) as buf:
            buf.tensor.fill_(7)
            buf.mark_in_flight(fence)
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(copier)
        await settle()
        tg.start_soon(_append, pool, got, 16)
        await settle()
        # The lease has ended but the copy reading the buffer has not: nobody gets it.
        assert not got and not released.is_set()
        assert pool.statistics().in_use == 1 and pool.statistics().waiting == 1
        fence.complete()
    assert released.is_set() and len(got) == 1


async def test_plain_release_parks_an_in_flight_buffer_until_its_fence_completes() -> None:
    pool, _ = make_pool(1, poll_interval=0.001)
    buf = await pool.acquire(16)
    fence = ManualFence()
    buf.mark_in_flight(fence)
    pool.release(buf)
    s = pool.statistics()
    assert (s.in_use, s.in_flight) == (0, 1)
    with pytest.raises(anyio.WouldBlock):
        pool.acquire_nowait(16)
    got: list[PinnedBuffer] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_append, pool, got, 16)
        await anyio.sleep(0.02)
        assert not got
        fence.complete()  # a waiting acquirer polls the parked fence
    assert len(got) == 1 and pool.statistics().in_flight == 0


async def test_waiter_queued_before_a_slot_is_parked_gets_it_when_the_copy_completes() -> None:
    pool, _ = make_pool(1, poll_interval=0.001)
    held = await pool.acquire(8)
    got: list[PinnedBuffer] = []
    fence = ManualFence()
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_append, pool, got, 8)
            await settle()
            held.mark_in_flight(fence)
            pool.release(held)  # parked: the waiter must start watching its fence
            await anyio.sleep(0.01)
            assert not got
            fence.complete()
    assert [b.index for b in got] == [held.index]


async def test_release_timeout_parks_then_reclaims() -> None:
    pool, _ = make_pool(1, release_timeout=0.02)
    fence = ManualFence()
    async with pool.lease(8) as buf:
        buf.mark_in_flight(fence)
    s = pool.statistics()
    assert (s.in_use, s.in_flight) == (0, 1)
    with pytest.raises(anyio.WouldBlock):
        pool.acquire_nowait(8)
    fence.complete()
    again = pool.acquire_nowait(8)
    assert again.index == buf.index and pool.statistics().in_flight == 0


async def test_buffer_returned_after_an_error() -> None:
    pool, _ = make_pool(1)
    with pytest.raises(ZeroDivisionError):
        async with pool.lease(8):
            1 / 0  # noqa: B018
    assert pool.statistics().in_use == 0
    pool.release(pool.acquire_nowait(8))


async def test_cancelled_waiter_leaves_the_queue() -> None:
    pool, _ = make_pool(1)
    held = await pool.acquire(8)
    with anyio.move_on_after(0.01) as scope:
        await pool.acquire(8)
    assert scope.cancelled_caught
    assert pool.statistics().waiting == 0
    pool.release(held)
    pool.release(pool.acquire_nowait(8))
    assert pool.statistics().in_use == 0


async def test_waiter_cancelled_after_handoff_passes_the_slot_on() -> None:
    pool, _ = make_pool(1)
    held = await pool.acquire(8)
    got: list[PinnedBuffer] = []
    async with anyio.create_task_group() as tg:
        first = anyio.CancelScope()

        async def cancelled_waiter() -> None:
            with first:
                await _append(pool, got, 8)

        tg.start_soon(cancelled_waiter)
        await settle()
        tg.start_soon(_append, pool, got, 8)
        await settle()
        # Cancel the first waiter, and hand it the slot before it can run.
        first.cancel()
        pool.release(held)
    assert len(got) == 1  # the second waiter
    assert pool.statistics().in_use == 1 and pool.statistics().waiting == 0


async def test_cancelled_user_keeps_buffer_until_copy_completes() -> None:
    pool, _ = make_pool(1)
    fence = ManualFence()
    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def user() -> None:
            with scope:
                async with pool.lease(8) as buf:
                    buf.mark_in_flight(fence)
                    await anyio.sleep_forever()
            done.set()

        tg.start_soon(user)
        await settle()
        scope.cancel()
        await anyio.sleep(0.01)
        # Cancelled, but the release waits (shielded) for the copy that reads the buffer.
        assert not done.is_set() and pool.statistics().in_use == 1
        fence.complete()
    assert done.is_set() and pool.statistics().in_use == 0


async def test_cancelled_during_growth_returns_slot() -> None:
    gate = threading.Event()

    def slow(nbytes: int) -> torch.Tensor:
        gate.wait(10)
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = PinnedBufferPool(1, buffer_bytes=8, max_buffer_bytes=8, allocator=slow)
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def grab() -> None:
            with scope:
                async with pool.lease(8):
                    await anyio.sleep_forever()

        tg.start_soon(grab)
        await anyio.sleep(0.02)
        scope.cancel()  # while the allocation runs in its thread
        await anyio.sleep(0.01)
        gate.set()
    s = pool.statistics()
    assert (s.in_use, s.allocated) == (0, 1)
    pool.release(pool.acquire_nowait(8))


async def test_allocator_failure_returns_slot() -> None:
    pool, _ = make_pool(1, allocator=Allocator(fail=1))
    with pytest.raises(MemoryError):
        await pool.acquire(8)
    assert pool.statistics().in_use == 0
    pool.release(await pool.acquire(8))

    bad, _ = make_pool(1, allocator=lambda n: torch.empty(n, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="1-D uint8"):
        await bad.acquire(8)
    assert bad.statistics().in_use == 0


async def test_growth_is_bounded() -> None:
    pool, alloc = make_pool(3, buffer_bytes=16, max_buffer_bytes=256)
    assert pool.fits(256) and not pool.fits(257) and not pool.fits(-1)
    with pytest.raises(ValueError, match="max_buffer_bytes=256"):
        await pool.acquire(257)
    rng = random.Random(0)
    held: list[PinnedBuffer] = []
    for _ in range(200):
        if len(held) == 3 or (held and rng.random() < 0.5):
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randrange(0, 257)
            buf = await pool.acquire(n)
            assert buf.tensor.numel() == n
            held.append(buf)
        assert pool.statistics().total_bytes <= 3 * 256
    assert all(16 <= s <= 256 and s & (s - 1) == 0 for s in alloc.sizes)
    assert pool.statistics().allocated <= 3


async def test_preallocate() -> None:
    pool, alloc = make_pool(3)
    await pool.preallocate()
    s = pool.statistics()
    assert (s.allocated, s.in_use, s.total_bytes) == (3, 0, 3 * 64)
    await pool.acquire(64)
    assert len(alloc.sizes) == 3


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="max_buffers"):
        PinnedBufferPool(0)
    with pytest.raises(ValueError, match="buffer_bytes"):
        PinnedBufferPool(1, buffer_bytes=100, max_buffer_bytes=10)


def test_default_allocator_pins_only_with_cuda() -> None:
    pool = PinnedBufferPool(1, buffer_bytes=8, max_buffer_bytes=8, pin_memory=False)
    assert not pool.statistics().pinned
    assert PinnedBufferPool(1).statistics().pinned == torch.cuda.is_available()


@pytest.mark.parametrize("seed", range(12))
async def test_randomized_concurrent_accounting(seed: int) -> None:
    """Many tasks, random sizes, errors, cancellations and copies in flight."""
    rng = random.Random(seed)
    pool, _ = make_pool(3, buffer_bytes=16, max_buffer_bytes=512, poll_interval=0.001)
    holders: dict[int, int] = {}
    fences: dict[int, ManualFence] = {}  # slot -> the fence of the last copy from it
    acquired = 0

    async def complete_later(fence: ManualFence, delay: float) -> None:
        await anyio.sleep(delay)
        fence.complete()

    async def user(tid: int, tg: anyio.abc.TaskGroup) -> None:
        n = rng.randrange(1, 513)
        action = rng.choice(["ok", "ok", "error", "cancel", "in_flight", "sync_release"])
        await anyio.sleep(rng.random() * 0.005)

        async def use(buf: PinnedBuffer) -> None:
            nonlocal acquired
            acquired += 1
            i = buf.index
            assert i not in holders, f"slot {i} handed to {tid} and {holders.get(i)}"
            prev = fences.get(i)
            assert prev is None or prev.query(), f"slot {i} reused during its copy"
            holders[i] = tid
            try:
                buf.tensor.fill_(tid % 251)
                await anyio.sleep(rng.random() * 0.003)
                assert bool((buf.tensor == tid % 251).all()), f"slot {i} shared"
            finally:
                del holders[i]
            if action in ("in_flight", "sync_release"):
                fence = fences[i] = ManualFence()
                buf.mark_in_flight(fence)
                tg.start_soon(complete_later, fence, rng.random() * 0.01)
            if action == "error":
                raise KeyError(tid)
            if action == "cancel":
                await anyio.sleep_forever()

        # Only "cancel" may time out; any other task stuck for 5 s is a lost wake-up.
        limit = (
            anyio.move_on_after(rng.random() * 0.01) if action == "cancel" else anyio.fail_after(5)
        )
        with limit:
            try:
                if action == "sync_release":
                    buf = await pool.acquire(n)
                    try:
                        await use(buf)
                    finally:
                        pool.release(buf)  # parks the slot while its copy is in flight
                else:
                    async with pool.lease(n) as buf:
                        await use(buf)
            except KeyError:
                pass

    async with anyio.create_task_group() as tg:
        for tid in range(60):
            tg.start_soon(user, tid, tg)
    s = pool.statistics()
    assert (s.in_use, s.waiting, s.in_flight) == (0, 0, 0)
    assert s.acquisitions == acquired and s.peak_in_use <= 3
    assert s.total_bytes <= s.max_total_bytes
    bufs = [pool.acquire_nowait(1) for _ in range(3)]  # every slot is back
    assert sorted(b.index for b in bufs) == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_event_fence() -> None:
    stream = torch.cuda.Stream()
    x = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(stream):
        y = x.to("cuda", non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    fence = CudaEventFence(event)
    await fence.wait()
    assert fence.query() and y.numel() == x.numel()
