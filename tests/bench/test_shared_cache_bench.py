"""The shared-cache benchmark's workload: Zipf popularity over one image pool, replayed exactly.

No timing is asserted: CPU per image and hit rates are what the benchmark prints, side by side.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("shared_cache_bench")


def test_zipf_requests_are_reproducible_skewed_and_in_the_pool() -> None:
    bench = _bench()
    a = bench.zipf_requests(2000, 50, 1.1, seed=3)
    assert a == bench.zipf_requests(2000, 50, 1.1, seed=3)
    assert a != bench.zipf_requests(2000, 50, 1.1, seed=4)
    assert set(a) <= set(range(50))
    counts = Counter(a)
    # rank 0 is drawn about 2**1.1 times as often as rank 1, and far more than the tail
    assert counts[0] > 1.5 * counts[1] > 0
    assert counts[0] > 10 * max(counts[i] for i in range(40, 50))
