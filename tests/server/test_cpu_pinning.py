"""Each worker's share of the cores (``aiomm serve --pin-workers``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from aiomm.server.runtime.pinning import worker_cpus


@pytest.mark.parametrize(
    ("cpus", "workers", "expected"),
    [
        ([0, 1], 2, [{0}, {1}]),
        ([1, 0], 1, [{0, 1}]),
        ([0, 1], 3, [{0}, {1}, {0}]),
        (list(range(8)), 2, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
        (list(range(8)), 3, [{0, 1}, {2, 3, 4}, {5, 6, 7}]),
        ([2, 5, 9], 2, [{2}, {5, 9}]),
    ],
)
def test_workers_get_consecutive_shares_or_one_core_each(
    cpus: list[int], workers: int, expected: list[set[int]]
) -> None:
    assert worker_cpus(cpus, workers) == expected


@pytest.mark.parametrize(("cpus", "workers"), [([], 2), ([0, 1], 0)])
def test_no_cores_or_no_workers_is_an_error(cpus: list[int], workers: int) -> None:
    with pytest.raises(ValueError, match="cores"):
        worker_cpus(cpus, workers)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_every_thread_of_the_process_is_pinned_and_new_ones_inherit() -> None:
    # in a child: pinning the test process would pin the rest of the suite
    code = textwrap.dedent(
        """
        import os, threading
        from aiomm.server.runtime.pinning import pin_process

        def tasks():
            return {int(t) for t in os.listdir("/proc/self/task")}

        stop = threading.Event()
        started = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]
        for t in started:
            t.start()
        before = tasks()
        core = min(os.sched_getaffinity(0))
        assert pin_process(frozenset({core})) == len(before) >= 4
        later = threading.Thread(target=stop.wait, daemon=True)
        later.start()
        assert len(tasks()) == len(before) + 1
        assert all(os.sched_getaffinity(tid) == {core} for tid in tasks())
        stop.set()
        print("pinned", core)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pinned")
