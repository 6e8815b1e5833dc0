"""Single-flight: concurrent requests for the same key share one computation.

The computation runs as a task in a task group the owner (the Engine) supplies, never in the task
of the caller that started it. Callers only wait for an :class:`anyio.Event`, so cancelling any
caller, the first one included, detaches that caller alone: the computation goes on and the other
callers still get its result. If every caller detaches, the computation still finishes and may
still store its result.

Thread safety: none. Use it from the event-loop thread only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from aiomm.errors import EngineClosedError
from aiomm.logging import get_logger

__all__ = ("SingleFlight", "SingleFlightStatistics")

logger = get_logger(__name__)

T = TypeVar("T")

_UNSET: Any = object()


@dataclass(frozen=True)
class SingleFlightStatistics:
    """A snapshot of a :class:`SingleFlight`."""

    #: computations running now
    in_flight: int
    #: callers waiting for a computation now
    waiters: int
    #: computations started since creation
    started: int
    #: callers that joined a computation another caller started
    joins: int
    #: computations that raised
    failures: int
    #: times :meth:`SingleFlight.invalidate` was called
    generation: int


@dataclass(eq=False)
class _Flight:
    generation: int
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = _UNSET
    error: BaseException | None = None
    traceback: TracebackType | None = None


class SingleFlight:
    """Deduplicates concurrent computations of the same key.

    :param task_group: where computations run; it must outlive every call to :meth:`do`. When it
        is cancelled, callers of unfinished computations get
        :class:`~aiomm.errors.EngineClosedError`.
    """

    def __init__(self, task_group: TaskGroup) -> None:
        self._task_group = task_group
        self._flights: dict[str, _Flight] = {}
        self._generation = 0
        self._running = 0
        self._waiters = 0
        self._started = 0
        self._joins = 0
        self._failures = 0

    @property
    def generation(self) -> int:
        """The current generation; :meth:`invalidate` increments it."""
        return self._generation

    def invalidate(self) -> None:
        """Start a new generation: running computations will not call their ``store``.

        Running computations are forgotten too, so later callers of the same key start a fresh one
        instead of joining a stale one; callers already waiting still get the old result.
        """
        self._generation += 1
        self._flights.clear()

    async def do(
        self,
        key: str,
        fn: Callable[[], Awaitable[T]],
        *,
        store: Callable[[T], Awaitable[object]] | None = None,
    ) -> tuple[T, bool]:
        """Return ``fn()``'s result for ``key``, computing it at most once among concurrent callers.

        The caller that finds no computation for ``key`` starts ``fn`` (and only its ``fn`` and
        ``store`` are used); callers arriving while it runs join it. When ``fn`` returns, ``store``
        is awaited with its result before any caller wakes, but only if :meth:`invalidate` was not
        called meanwhile; an exception from ``store`` is logged and swallowed (the result is still
        served). Failures are not remembered: the next call after one recomputes.

        :returns: the result and whether this caller joined a computation another caller started.
        :raises: whatever ``fn`` raised, for every caller of that computation.
        :raises EngineClosedError: if the task group was cancelled before ``fn`` finished.
        :raises RuntimeError: if the task group is no longer running.
        """
        flight = self._flights.get(key)
        joined = flight is not None
        if flight is None:
            flight = _Flight(self._generation)
            self._task_group.start_soon(
                self._run, key, flight, fn, store, name=f"singleflight {key}"
            )
            self._flights[key] = flight
            self._started += 1
        else:
            self._joins += 1

        self._waiters += 1
        try:
            # Only this wait is cancelled when the caller is; the computation is not ours to stop.
            await flight.done.wait()
        finally:
            self._waiters -= 1
        if flight.error is not None:
            # Re-attach the original traceback so each waiter's raise does not grow the shared one.
            raise flight.error.with_traceback(flight.traceback)
        result: T = flight.result
        return result, joined

    def statistics(self) -> SingleFlightStatistics:
        """Return a snapshot of the counters."""
        return SingleFlightStatistics(
            in_flight=self._running,
            waiters=self._waiters,
            started=self._started,
            joins=self._joins,
            failures=self._failures,
            generation=self._generation,
        )

    async def _run(
        self,
        key: str,
        flight: _Flight,
        fn: Callable[[], Awaitable[T]],
        store: Callable[[T], Awaitable[object]] | None,
    ) -> None:
        self._running += 1
        try:
            result = await fn()
            if store is not None and flight.generation == self._generation:
                try:
                    await store(result)
                except Exception as exc:
                    logger.warning("singleflight_store_failed", key=key, error=repr(exc))
            flight.result = result
        except anyio.get_cancelled_exc_class():
            flight.error = EngineClosedError("the engine closed while an item was being computed")
            raise
        except Exception as exc:
            # Handed to the waiters instead of raised: one bad item must not crash the task group.
            self._failures += 1
            flight.error, flight.traceback = exc, exc.__traceback__
            logger.debug("singleflight_failed", key=key, error=repr(exc))
        except BaseException as exc:
            # KeyboardInterrupt and the like still tear the task group down, after waking waiters.
            flight.error, flight.traceback = exc, exc.__traceback__
            raise
        finally:
            self._running -= 1
            if self._flights.get(key) is flight:
                del self._flights[key]
            flight.done.set()
