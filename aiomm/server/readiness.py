"""Readiness (``GET /ready``, also ``/readyz``, the paths vLLM's data-parallel supervisor
answers): whether the server can serve now, as opposed to ``/health``, vLLM's liveness check,
which says only that the process runs.

Each dependency the server was configured with is a named check: the upstream engine's
``/health`` in gateway mode, a ``PING`` to the shared Redis cache when one is configured. A
required check that fails makes the server unready (503: every request would fail); an optional
one only degrades it (200, named under ``degraded``): without Redis the engine computes items
locally, and taking every replica out of the load balancer at once for a cache outage would turn
a slower service into none. The
checks run concurrently, each bounded by a short timeout, and their report is kept for a short
while (``cache_s``) and shared by every probe that arrives meanwhile, so a storm of probes sends
the dependencies one check per ``cache_s`` per process. A failed check names its dependency and
says why in a few words (an exception's type, a status code), never a URL, key or payload.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

__all__ = ("Check", "DependencyDown", "Readiness", "ReadinessReport", "redis_check")

#: a check: returns when the dependency answers, raises :class:`DependencyDown` (or anything
#: else, reported by its type) when it does not
Check = Callable[[], Awaitable[None]]


class DependencyDown(Exception):
    """Raised by a readiness check whose dependency does not answer as it should; its message
    is the reason the report gives."""


@dataclass(frozen=True)
class ReadinessReport:
    """One run of every check."""

    #: each check's name -> None when it passed, else why it failed
    failures: Mapping[str, str | None]
    #: the checks whose failure only degrades the server
    optional: frozenset[str] = frozenset()

    @property
    def ready(self) -> bool:
        return not any(why for name, why in self.failures.items() if name not in self.optional)

    def body(self) -> dict[str, Any]:
        """The JSON body ``/ready`` answers: ``ready``, the required checks that failed
        (``down``), the optional ones that failed (``degraded``) and each check's outcome."""
        return {
            "ready": self.ready,
            "down": [n for n, why in self.failures.items() if why and n not in self.optional],
            "degraded": [n for n, why in self.failures.items() if why and n in self.optional],
            "checks": {
                name: {"ok": True} if why is None else {"ok": False, "error": why}
                for name, why in self.failures.items()
            },
        }


class Readiness:
    """Runs ``checks`` (name -> :data:`Check`) for ``/ready``; see the module docstring.

    :param optional: the names of the checks whose failure only degrades the server.
    :param timeout_s: how long each check may take before it counts as failed.
    :param cache_s: how long a report is reused; probes that arrive while a run is under way wait
        for it rather than starting their own.
    """

    def __init__(
        self,
        checks: Mapping[str, Check],
        *,
        optional: frozenset[str] = frozenset(),
        timeout_s: float = 0.5,
        cache_s: float = 1.0,
    ) -> None:
        self.checks = dict(checks)
        self.optional = optional
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._lock = anyio.Lock()
        self._report: ReadinessReport | None = None
        self._at = 0.0

    async def report(self) -> ReadinessReport:
        """The latest report, run again when older than ``cache_s``."""
        async with self._lock:
            if self._report is None or time.monotonic() - self._at >= self.cache_s:
                self._report = await self._run()
                self._at = time.monotonic()
            return self._report

    async def _run(self) -> ReadinessReport:
        failures: dict[str, str | None] = dict.fromkeys(self.checks)

        async def one(name: str, check: Check) -> None:
            try:
                with anyio.fail_after(self.timeout_s):
                    await check()
            except TimeoutError:
                failures[name] = f"no answer within {self.timeout_s:g} s"
            except DependencyDown as exc:
                failures[name] = str(exc)
            except Exception as exc:  # the type only: messages may hold addresses
                failures[name] = f"unreachable ({type(exc).__name__})"

        async with anyio.create_task_group() as tg:
            for name, check in self.checks.items():
                tg.start_soon(one, name, check)
        return ReadinessReport(failures, self.optional)


def redis_check(url: str, timeout_s: float) -> tuple[Check, Callable[[], Awaitable[None]]]:
    """A check that sends ``PING`` to the Redis of ``url`` over a connection of its own (not the
    item cache's, whose commands it would queue behind), and the coroutine that closes it.

    :raises ImportError: the ``redis`` client is not installed (the ``shared-cache`` extra).
    """
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    client = Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )

    async def check() -> None:
        if not await client.ping():
            raise DependencyDown("PING was not answered with PONG")

    return check, client.aclose
