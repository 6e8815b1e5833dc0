"""ResultStream: every ``__anext__`` is a cancellation point, and the source is closed (its
``finally`` runs) when the stream ends or is closed, not at garbage collection."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Iterator

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from aiomm.engine._stream import ResultStream
from aiomm.types import Request, Result


def requests(n: int) -> list[Request]:
    return [Request(prompt="p", request_id=str(i)) for i in range(n)]


async def fast_except_first(request: Request) -> Result:
    if request.request_id == "0":
        await anyio.sleep(0.2)  # the others finish first and wait in the ordered buffer
    return Result(request_id=request.request_id or "")


async def test_buffered_results_are_not_handed_to_a_cancelled_consumer() -> None:
    received_after_cancel = 0
    async with anyio.create_task_group() as tg:
        stream = ResultStream(
            lambda: tg, fast_except_first, requests(41), ordered=True, max_in_flight=64,
            raise_errors=False,
        )  # fmt: skip
        async with stream:
            with anyio.CancelScope() as scope:
                async for result in stream:
                    if result.request_id == "0":
                        scope.cancel()  # 40 results are buffered by now
                    else:
                        received_after_cancel += 1
    assert received_after_cancel == 0
    assert scope.cancelled_caught


class Source:
    """An async generator source that records when its ``finally`` ran."""

    def __init__(self) -> None:
        self.closed = False
        self.yielded = 0

    async def gen(self, n: int) -> AsyncIterator[Request]:
        try:
            for request in requests(n):
                self.yielded += 1
                yield request
        finally:
            self.closed = True


async def echo(request: Request) -> Result:
    await anyio.lowlevel.checkpoint()
    return Result(request_id=request.request_id or "")


@pytest.mark.parametrize("taken", [0, 1, 3])
async def test_closing_the_stream_closes_the_source_at_once(taken: int) -> None:
    source = Source()
    gen = source.gen(100)
    ref = weakref.ref(gen)
    async with anyio.create_task_group() as tg:
        stream = ResultStream(lambda: tg, echo, gen, ordered=True, max_in_flight=2,
                              raise_errors=False)  # fmt: skip
        del gen
        async with stream:
            for _ in range(taken):
                await stream.__anext__()
        # the source waits for a slot (max_in_flight=2); closing the stream runs its finally now
        # (a generator never started has no finally to run)
        assert source.closed == (taken > 0)
        assert ref() is None  # and the stream holds it no more
        assert source.yielded <= taken + 2


async def test_a_stream_that_ends_closes_and_drops_its_sync_source() -> None:
    closed: list[bool] = []

    def gen() -> Iterator[Request]:
        try:
            yield from requests(3)
        finally:
            closed.append(True)

    async with anyio.create_task_group() as tg:
        stream = ResultStream(lambda: tg, echo, gen(), ordered=False, max_in_flight=8,
                              raise_errors=False)  # fmt: skip
        async with stream:
            assert len([r async for r in stream]) == 3
        assert closed == [True]
        assert stream._source is None and stream._iterator is None


async def test_a_source_that_raises_while_closing_ends_the_stream_with_it() -> None:
    async def gen() -> AsyncIterator[Request]:
        try:
            yield requests(1)[0]
            await anyio.sleep(10)
        finally:
            raise RuntimeError("source cleanup failed")

    async with anyio.create_task_group() as tg:
        stream = ResultStream(lambda: tg, echo, gen(), ordered=True, max_in_flight=1,
                              raise_errors=False)  # fmt: skip
        async with stream:
            with anyio.fail_after(5):
                assert (await stream.__anext__()).request_id == "0"


async def test_a_stream_of_a_closed_engine_closes_at_once() -> None:
    from aiomm.errors import EngineClosedError

    def closed() -> anyio.abc.TaskGroup:
        raise EngineClosedError("the engine is not open")

    stream = ResultStream(closed, echo, requests(3), ordered=True, max_in_flight=2,
                          raise_errors=False)  # fmt: skip
    with anyio.fail_after(2):  # before: aclose waited for a producer that never started
        async with stream:
            with pytest.raises(EngineClosedError):
                await stream.__anext__()
