"""ResultStream: ``engine.stream(requests)``, bounded and backpressured.

A producer task, started in the engine's task group (never in the consumer's frame: yielding from
inside a task group breaks structured concurrency), takes a request from the source only after
acquiring one of ``max_in_flight`` slots; a slot is returned when the consumer receives that
request's result. Requests taken from the source but not yet yielded therefore never exceed
``max_in_flight``, however large the source, and a slow consumer stops the producer.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio
import anyio.abc

from aiomm.errors import ConfigError
from aiomm.types import Request, Result

__all__ = ("ResultStream",)


class ResultStream:
    """Async iterator (and async context manager) over the results of a request source.

    ``task_group`` returns the task group the producer runs in (the engine's, looked up when
    iteration starts); ``process`` turns a request into a result, never raising for a failed
    request (``Engine.process_safe``).
    """

    def __init__(
        self,
        task_group: Callable[[], anyio.abc.TaskGroup],
        process: Callable[[Request], Awaitable[Result]],
        source: Iterable[Request] | AsyncIterable[Request],
        *,
        ordered: bool,
        max_in_flight: int,
        raise_errors: bool,
    ) -> None:
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight={max_in_flight} must be a positive integer")
        self._task_group = task_group
        self._process = process
        self._source = source
        self._ordered = ordered
        self._max_in_flight = max_in_flight
        self._raise_errors = raise_errors
        self._slots = anyio.Semaphore(max_in_flight)
        self._scope = anyio.CancelScope()
        send, recv = anyio.create_memory_object_stream[tuple[int, Result]](max_in_flight)
        self._send: anyio.abc.ObjectSendStream[tuple[int, Result]] | None = send
        self._recv = recv
        self._buffer: dict[int, Result] = {}
        self._next_index = 0
        self._started = False
        self._source_error: BaseException | None = None
        #: requests taken from the source so far
        self.taken = 0
        #: results handed to the consumer so far
        self.yielded = 0

    async def __aenter__(self) -> ResultStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[Result]:
        return self

    async def aclose(self) -> None:
        """Stop the producer and every request of this stream still in flight."""
        self._scope.cancel()
        await self._recv.aclose()

    def _start(self) -> None:
        self._started = True
        send, self._send = self._send, None
        assert send is not None
        self._task_group().start_soon(self._produce, send)

    async def _produce(self, send: anyio.abc.ObjectSendStream[tuple[int, Result]]) -> None:
        with self._scope:
            async with send, anyio.create_task_group() as tg:
                try:
                    async for index, request in self._enumerate():
                        tg.start_soon(self._run_one, index, request, send.clone())
                except Exception as exc:  # the source itself failed: end the stream with it
                    self._source_error = exc

    async def _enumerate(self) -> AsyncIterator[tuple[int, Request]]:
        source: Any = self._source
        is_async = isinstance(source, AsyncIterable)
        iterator: Any = aiter(source) if is_async else iter(source)
        index = 0
        while True:
            # Acquire first, then take: a request is never pulled without a slot for it.
            await self._slots.acquire()
            try:
                request = await anext(iterator) if is_async else next(iterator)
            except (StopIteration, StopAsyncIteration):
                self._slots.release()
                return
            self.taken += 1
            yield index, request
            index += 1

    async def _run_one(
        self, index: int, request: Request, send: anyio.abc.ObjectSendStream[tuple[int, Result]]
    ) -> None:
        async with send:
            await send.send((index, await self._process(request)))

    async def __anext__(self) -> Result:
        if not self._started:
            self._start()
        while True:
            if self._ordered and self._next_index in self._buffer:
                return self._deliver(self._buffer.pop(self._next_index))
            try:
                index, result = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if self._source_error is not None:
                    error, self._source_error = self._source_error, None
                    raise error from None
                raise StopAsyncIteration from None
            if not self._ordered:
                return self._deliver(result)
            self._buffer[index] = result

    def _deliver(self, result: Result) -> Result:
        self._next_index += 1
        self.yielded += 1
        self._slots.release()
        if self._raise_errors and result.error is not None:
            raise result.error
        return result
