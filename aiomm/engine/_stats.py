"""Statistics records: per-stage latency percentiles, counters, and their frozen snapshots."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ("LatencyStats", "StageRecorder", "percentile")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (nan when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class LatencyStats:
    """Latency of one stage over the recent window, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(values: Iterable[float], count: int) -> LatencyStats:
        data = sorted(values)
        if not data:
            return LatencyStats(count, math.nan, math.nan, math.nan, math.nan, math.nan)
        return LatencyStats(
            count=count,
            mean=sum(data) / len(data),
            p50=percentile(data, 50),
            p90=percentile(data, 90),
            p99=percentile(data, 99),
            max=data[-1],
        )


@dataclass
class StageRecorder:
    """Keeps the last ``window`` durations of each stage (bounded memory) and total counts."""

    window: int = 4096
    _samples: dict[str, collections.deque[float]] = field(default_factory=dict)
    _counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def record(self, stage: str, seconds: float) -> None:
        samples = self._samples.get(stage)
        if samples is None:
            samples = self._samples[stage] = collections.deque(maxlen=self.window)
        samples.append(seconds)
        self._counts[stage] += 1

    def record_all(self, timings: Mapping[str, float]) -> None:
        for stage, seconds in timings.items():
            self.record(stage, seconds)

    def snapshot(self) -> dict[str, LatencyStats]:
        return {s: LatencyStats.of(v, self._counts[s]) for s, v in self._samples.items()}


def as_dict(obj: Any) -> Any:
    """Frozen stats records (nested) as plain JSON-friendly dicts."""
    if hasattr(obj, "__dataclass_fields__"):
        return {k: as_dict(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, Mapping):
        return {str(k): as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_dict(v) for v in obj]
    return obj
