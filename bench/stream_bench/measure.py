"""What a run costs: wall and CPU time, RSS sampled in a thread, latency percentiles, cores.

Standard library and numpy only: the vLLM worker measures with this module too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def pinned(n: int) -> Iterator[int]:
    """Restrict every thread of this process to its first ``n`` cores; yields the core count.

    Thread scaling means cores too: with 1 transform thread the engine's other threads (event
    loop, device stage) would otherwise still run on a second core.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        yield cores()
        return

    def apply(cpus: Sequence[int]) -> None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that just exited
                os.sched_setaffinity(int(tid), cpus)

    if n >= len(allowed):
        yield len(allowed)
        return
    apply(allowed[:n])
    try:
        yield n
    finally:
        apply(allowed)


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Nearest-rank percentiles ``qs`` (0-100) of ``values``; nan for each when it is empty."""
    if not values:
        return [float("nan")] * len(qs)
    # inverted_cdf is the nearest-rank definition: every percentile is an observed latency
    return [float(v) for v in np.percentile(values, qs, method="inverted_cdf")]


def rss_bytes() -> int:
    """Resident set size of this process now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Meter:
    """Wall time, CPU time of every thread of this process, and RSS sampled in a thread."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self.t0 = self.t1 = 0.0
        self.cpu0 = self.cpu1 = 0.0
        #: the last arrival of an open loop: RSS growth is judged up to there
        self.end: float | None = None

    def _sample(self) -> None:
        while True:
            self.samples.append((time.perf_counter(), rss_bytes()))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Meter:
        times = os.times()
        self.cpu0, self.t0 = times.user + times.system, time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        times = os.times()
        self.cpu1, self.t1 = times.user + times.system, time.perf_counter()
        self._stop.set()
        self._thread.join()
        self.samples.append((self.t1, rss_bytes()))

    def growth(self, samples: Sequence[tuple[float, float]]) -> float:
        """Peak in the second half of the window minus peak in its first half.

        The window runs from the start to ``end`` (the last arrival of an open loop: a backlog
        is largest there) or else to the end of the run.
        """
        end = self.end or self.t1
        mid = (self.t0 + end) / 2
        first = [v for t, v in samples if t <= mid] or [samples[0][1]]
        second = [v for t, v in samples if mid < t <= end] or first
        return max(second) - max(first)

    def rss(self) -> dict[str, float]:
        """Peak, start and growth of the RSS, in MB."""
        mb = 1 / 2**20
        return {
            "rss_peak_mb": max(r for _, r in self.samples) * mb,
            "rss_start_mb": self.samples[0][1] * mb,
            "rss_growth_mb": self.growth(self.samples) * mb,
        }
