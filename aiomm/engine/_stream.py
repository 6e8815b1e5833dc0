"""ResultStream: ``engine.stream(requests)``, bounded and backpressured.

A producer task, started in the engine's task group (never in the consumer's frame: yielding from
inside a task group breaks structured concurrency), takes a request from the source only after
acquiring one of ``max_in_flight`` slots; a slot is returned when the consumer receives that
request's result. Requests taken from the source but not yet yielded therefore never exceed
``max_in_flight``, however large the source, and a slow consumer stops the producer.

Every ``__anext__`` is a cancellation point, buffered results included (trio's rule). When the
stream ends or is closed, the source is closed (an async generator's ``aclose()``, a generator's
``close()``: its ``finally`` runs then, not at garbage collection) and the stream drops it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel

from aiomm.errors import ConfigError
from aiomm.types import Request, Result

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

__all__ = ("ResultStream",)

# how long closing a stream waits for its producer (and the source's finally) to stop
_CLOSE_WAIT_S = 10.0


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
        self._source: Iterable[Request] | AsyncIterable[Request] | None = source
        self._iterator: Any = None
        self._ordered = ordered
        self._max_in_flight = max_in_flight
        self._raise_errors = raise_errors
        self._slots = anyio.Semaphore(max_in_flight)
        self._scope = anyio.CancelScope()
        send, recv = anyio.create_memory_object_stream[tuple[int, Result]](max_in_flight)
        self._send: MemoryObjectSendStream[tuple[int, Result]] | None = send
        self._recv = recv
        self._buffer: dict[int, Result] = {}
        self._next_index = 0
        self._started = False
        self._done = anyio.Event()
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
        """Stop the producer and every request of this stream still in flight, and close the
        source."""
        self._scope.cancel()
        await self._recv.aclose()
        if not self._started:  # never iterated: the producer that would close it never ran
            self._started = True
            send, self._send = self._send, None
            if send is not None:
                await send.aclose()
            source, self._source = self._source, None
            if inspect.isasyncgen(source) or inspect.isgenerator(source):
                self._iterator = source
                await self._close_source()
            self._done.set()
        # Wait for the producer to stop, so the source's ``finally`` has run when this returns;
        # requests in worker threads finish first (threads are never abandoned).
        with anyio.move_on_after(_CLOSE_WAIT_S, shield=True):
            await self._done.wait()

    def _start(self) -> None:
        self._started = True
        send, self._send = self._send, None
        assert send is not None
        try:
            self._task_group().start_soon(self._produce, send)
        except BaseException:  # e.g. the engine is closed: no producer will ever run
            send.close()
            self._done.set()
            raise

    async def _produce(self, send: MemoryObjectSendStream[tuple[int, Result]]) -> None:
        source: Any = self._source
        self._source = None
        is_async = isinstance(source, AsyncIterable)
        try:
            with self._scope:
                async with send, anyio.create_task_group() as tg:
                    try:
                        self._iterator = aiter(source) if is_async else iter(source)
                        index = 0
                        while True:
                            # Acquire first, then take: never a request pulled without a slot.
                            await self._slots.acquire()
                            try:
                                if is_async:
                                    request = await anext(self._iterator)
                                else:
                                    request = next(self._iterator)
                            except (StopIteration, StopAsyncIteration):
                                self._slots.release()
                                break
                            self.taken += 1
                            tg.start_soon(self._run_one, index, request, send.clone())
                            index += 1
                    except Exception as exc:  # the source itself failed: end the stream with it
                        self._source_error = exc
        finally:
            await self._close_source()
            self._done.set()

    async def _close_source(self) -> None:
        iterator, self._iterator = self._iterator, None
        # Shielded and bounded: this runs while the producer is being cancelled, and a source's
        # ``finally`` that hangs must not hold the engine's shutdown.
        with anyio.move_on_after(5, shield=True):
            try:
                if hasattr(iterator, "aclose"):
                    await iterator.aclose()
                elif hasattr(iterator, "close"):
                    iterator.close()
            except Exception as exc:
                if self._source_error is None:
                    self._source_error = exc

    async def _run_one(
        self, index: int, request: Request, send: MemoryObjectSendStream[tuple[int, Result]]
    ) -> None:
        async with send:
            await send.send((index, await self._process(request)))

    async def __anext__(self) -> Result:
        # a checkpoint even when the next result is already buffered: a consumer whose scope
        # was cancelled gets no more results
        await anyio.lowlevel.checkpoint()
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
