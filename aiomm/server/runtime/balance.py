"""Keep-alive connections spread evenly over the workers of ``aiomm serve --workers N``.

Each worker listens with ``SO_REUSEPORT`` and the kernel hands every new connection to one of
them by a hash of its addresses. A client that keeps a few connections open for good (a gateway's
pool, the render benchmark's eight) then often leaves one worker with twice the other's
connections, and so twice its work: measured with two workers on 2 cores, a 1:2 split left
0.09-0.10 of a core idle, an even one 0.03, since one process cannot use both cores alone.

So the workers count their connections in one shared array (one slot each, -1 while a worker
does not serve), and a worker holding at least two more than the least loaded serving worker
answers the next request on one of them with ``Connection: close``: moving one connection then
narrows the gap. The client opens a new connection for its next request, which the kernel hashes
again (to any worker); the gap closes within a few requests. A connection marked for closing no
longer counts, so the requests in flight on a loaded worker do not all shed their connections.
Envoy's ``exact_balance`` evens out its worker threads' connections at accept time; here the
kernel picks the worker, so the workers even them out at request boundaries.
"""

from __future__ import annotations

from typing import Any

__all__ = ("NOT_SERVING", "ConnectionBalance", "current", "install")

#: a slot's value while its worker does not serve (starting, restarting or stopped)
NOT_SERVING = -1


class ConnectionBalance:
    """One worker's view of the shared connection counts (``counts``: a shared integer array,
    ``multiprocessing.RawArray('q', workers)``; ``index``: this worker's slot, written only by
    this worker and, once it has died, by the supervisor). Called from the event loop only."""

    def __init__(self, counts: Any, index: int) -> None:
        self._counts = counts
        self._index = index
        self._held = 0
        self._serving = False
        self._publish()

    def _publish(self) -> None:
        self._counts[self._index] = self._held if self._serving else NOT_SERVING

    def serving(self, on: bool = True) -> None:
        """This worker serves (True, once it listens) or no longer does (False: shutdown)."""
        self._serving = on
        self._publish()

    def opened(self) -> None:
        """A connection was accepted here."""
        self._held += 1
        self._publish()

    def released(self) -> None:
        """A counted connection closed, or was marked to close after its response."""
        self._held = max(0, self._held - 1)
        self._publish()

    def should_shed(self) -> bool:
        """True when this worker holds at least two connections more than the least loaded
        other serving worker; then the caller closes one connection after its response (it is
        already :meth:`released` here)."""
        if not self._serving:
            return False
        others = [c for i, c in enumerate(list(self._counts)) if i != self._index and c >= 0]
        if not others or self._held < min(others) + 2:
            return False
        self.released()
        return True


_current: ConnectionBalance | None = None


def install(balance: ConnectionBalance | None) -> None:
    """Make ``balance`` this process's (a worker of ``--workers N``; None: no balancing)."""
    global _current
    _current = balance


def current() -> ConnectionBalance | None:
    """This process's balance, if it is one of several workers."""
    return _current
