"""Closed and open loops against a system under test, each run summarised as a JSON record.

Standard library and numpy only: the vLLM worker drives its server with this module, so both
sides are measured the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .measure import Meter, cores, percentiles


@dataclass
class Done:
    """What a system reports for one finished request."""

    t_done: float
    images: int = 0
    hits: int = 0
    joins: int = 0
    error: str | None = None


class Server(Protocol):
    """A system under test: ``submit`` hands it one request of the workload.

    It returns a future of the request's :class:`Done`, or None when the system refuses the
    request (a full admission queue); ``wait=True`` (closed loop) waits for room instead.
    """

    async def submit(self, index: int, *, wait: bool) -> asyncio.Future[Done] | None: ...


MakeServer = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


@dataclass
class LoadResult:
    """The outcome of one loop: counts, latencies and the time span."""

    offered: int = 0
    completed: int = 0
    rejected: int = 0
    unfinished: int = 0
    errors: int = 0
    images: int = 0
    hits: int = 0
    joins: int = 0
    latencies: list[float] = field(default_factory=list)
    #: age of the requests still unfinished at the deadline (lower bounds of their latency)
    unfinished_ages: list[float] = field(default_factory=list)
    t_start: float = 0.0
    t_last: float = 0.0
    #: when the last request arrived (open loop); RSS growth is judged up to there
    t_arrived: float | None = None
    first_error: str | None = None

    def add(self, done: Done, latency: float) -> None:
        self.t_last = max(self.t_last, done.t_done)
        if done.error is not None:
            self.errors += 1
            self.first_error = self.first_error or done.error
            return
        self.completed += 1
        self.images += done.images
        self.hits += done.hits
        self.joins += done.joins
        self.latencies.append(latency)


class TaskServer:
    """A naive server: every request becomes a task running ``handler`` (no admission bound).

    ``receive(index)`` is the request arriving: its payload (with its own copy of the image
    bytes, as a request body would be) lives until the request is done.
    """

    def __init__(
        self, receive: Callable[[int], Any], handler: Callable[[Any], Awaitable[Done]]
    ) -> None:
        self._receive = receive
        self._handler = handler
        self._tasks: set[asyncio.Future[Done]] = set()

    async def __aenter__(self) -> TaskServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def submit(self, index: int, *, wait: bool) -> asyncio.Future[Done]:
        task = asyncio.ensure_future(self._handle(self._receive(index)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _handle(self, payload: Any) -> Done:
        try:
            return await self._handler(payload)
        except Exception as exc:
            return Done(time.perf_counter(), error=f"{type(exc).__name__}: {exc}"[:300])


async def closed_loop(server: Server, n: int, concurrency: int) -> LoadResult:
    """``concurrency`` clients, each sending its next request as soon as the previous returns."""
    res = LoadResult(offered=n, t_start=time.perf_counter())
    indices = iter(range(n))

    async def client() -> None:
        for i in indices:
            sent = time.perf_counter()
            future = await server.submit(i, wait=True)
            assert future is not None
            done = await future
            res.add(done, done.t_done - sent)

    await asyncio.gather(*(client() for _ in range(max(1, min(concurrency, n)))))
    return res


def arrival_times(seed: int, rate: float, window: float, max_requests: int) -> list[float]:
    """Poisson arrival offsets (s) at ``rate`` per second within ``window``; the same seed gives
    the same pattern at every rate (only the time scale changes)."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while len(out) < max_requests:
        t += rng.expovariate(1.0) / rate
        if t > window:
            break
        out.append(t)
    return out


async def open_loop(
    server: Server, n_workload: int, arrivals: Sequence[float], drain_s: float
) -> LoadResult:
    """Send request ``k % n_workload`` at ``arrivals[k]``, whatever the system is doing.

    Refused requests are counted as rejected. Requests still running ``drain_s`` after the last
    arrival are counted as unfinished, with their age as a lower bound of their latency.
    """
    res = LoadResult(offered=len(arrivals))
    t0 = res.t_start = time.perf_counter()
    pending: list[tuple[float, asyncio.Future[Done]]] = []
    for k, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        future = await server.submit(k % n_workload, wait=False)
        if future is None:
            res.rejected += 1
        else:
            pending.append((t0 + at, future))
    res.t_arrived = time.perf_counter()
    if pending:
        deadline = t0 + (arrivals[-1] if arrivals else 0.0) + drain_s
        await asyncio.wait(
            [f for _, f in pending], timeout=max(0.0, deadline - time.perf_counter())
        )
    now = time.perf_counter()
    for scheduled, future in pending:
        if future.done() and not future.cancelled():
            done = future.result()
            res.add(done, done.t_done - scheduled)
        else:
            res.unfinished += 1
            res.unfinished_ages.append(now - scheduled)
    return res


def summarise(res: LoadResult, meter: Meter) -> dict[str, Any]:
    """One run as a JSON record. Latency percentiles count unfinished requests at their age."""
    wall = (res.t_last - res.t_start) if res.completed else (meter.t1 - meter.t0)
    wall = max(wall, 1e-9)
    p50, p90, p99, worst = percentiles(res.latencies + res.unfinished_ages, (50, 90, 99, 100))
    elapsed = max(meter.t1 - meter.t0, 1e-9)
    return {
        "requests": res.offered,
        "completed": res.completed,
        "rejected": res.rejected,
        "unfinished": res.unfinished,
        "errors": res.errors,
        "first_error": res.first_error,
        "images": res.images,
        "wall_s": wall,
        "images_per_s": res.images / wall,
        "requests_per_s": res.completed / wall,
        "latency_ms": {
            "p50": p50 * 1000,
            "p90": p90 * 1000,
            "p99": p99 * 1000,
            "max": worst * 1000,
        },
        "cpu_s": meter.cpu1 - meter.cpu0,
        "cpu_util": (meter.cpu1 - meter.cpu0) / (elapsed * cores()),
        **meter.rss(),
        "cache_hits": res.hits,
        "cache_joins": res.joins,
    }


def run_async(main: Callable[[], Awaitable[Any]], loop: str = "uvloop") -> Any:
    """Run a coroutine on a fresh event loop (uvloop when asked for and installed)."""
    if loop == "uvloop" and sys.version_info >= (3, 11):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main())  # type: ignore[arg-type]
    return asyncio.run(main())  # type: ignore[arg-type]


def measured(
    make_server: MakeServer, load: Callable[[Any], Awaitable[LoadResult]], loop: str
) -> dict[str, Any]:
    """Open a fresh server, run ``load`` on it under a :class:`Meter`, and summarise.

    A server may have ``extra(meter)``, returning more fields for the record.
    """

    async def go() -> dict[str, Any]:
        async with make_server() as server:
            with Meter() as meter:
                res = await load(server)
            meter.end = res.t_arrived
            record = summarise(res, meter)
            extra = getattr(server, "extra", None)
        if extra is not None:
            record.update(extra(meter))
        return record

    return run_async(go, loop)


def drive(job: dict[str, Any], make_server: MakeServer, n_workload: int) -> dict[str, Any]:
    """The closed loop, then open loops at ``job['open_factors']`` x the measured capacity."""
    loop = job["loop"]
    n = min(job["requests"], n_workload)
    closed = measured(make_server, lambda s: closed_loop(s, n, job["concurrency"]), loop)
    closed.update(mode="closed", concurrency=job["concurrency"])
    opens = []
    capacity = closed["requests_per_s"]
    for factor in job["open_factors"] if capacity > 0 else ():
        rate = factor * capacity
        # never cycle past the workload: a second pass would be all cache hits
        arrivals = arrival_times(job["seed"], rate, job["window_s"], n)
        record = measured(
            make_server, lambda s, a=arrivals: open_loop(s, n, a, job["drain_s"]), loop
        )
        record.update(
            mode="open", factor=factor, offered_rps=rate, window_s=arrivals[-1] if arrivals else 0.0
        )
        opens.append(record)
    return {"status": "ok", "closed": closed, "open": opens}


def json_safe(obj: Any) -> Any:
    """``obj`` made JSON-safe: non-finite floats become None, paths strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
