"""``aiomm serve --workers N --pin-workers``: each worker process runs on its own share of the
cores.

Unpinned, the kernel moves a worker's threads (event loop, transform and encode threads) between
the cores as they sleep and wake, and the threads of one process hand the GIL to each other
across cores. Measured on the 2-core machine with two workers under the render benchmark's
load: unpinned, runnable worker threads waited in the run queue while the machine idled
0.05-0.07 of a core; pinned, each worker on a core of its own, it idled 0.00-0.01, and the server
answered 10% / 3% more images/s at 6% / 1% less CPU per image (8 / 32 clients, side by side).
nginx's ``worker_cpu_affinity auto`` does the same for its workers.

Off by default, as in nginx: two pinned servers on one host would share the same first cores
while the others idle, and a pinned worker cannot borrow a core that another program leaves free.
"""

from __future__ import annotations

import os
from collections.abc import Collection

__all__ = ("pin_process", "worker_cpus")


def worker_cpus(cpus: Collection[int], workers: int) -> list[frozenset[int]]:
    """The cores of each of ``workers`` processes, from the ``cpus`` the server may run on (in
    any order): consecutive equal shares (sizes differing by at most one) while there are at
    least as many cores as workers, else one core each, dealt round-robin.

    :raises ValueError: no cores or no workers.
    """
    if not cpus or workers < 1:
        raise ValueError(f"need cores and workers, got {len(cpus)} cores, {workers} workers")
    ordered = sorted(cpus)
    n = len(ordered)
    if workers >= n:
        return [frozenset({ordered[i % n]}) for i in range(workers)]
    return [frozenset(ordered[i * n // workers : (i + 1) * n // workers]) for i in range(workers)]


def pin_process(cpus: frozenset[int]) -> int:
    """Run every thread of this process on ``cpus`` from now on (threads started later inherit
    their starter's cores); the number of threads pinned.

    Linux sets a CPU affinity per thread, so each thread in ``/proc/self/task`` is set; the
    listing is read again until it holds no thread not yet set, for a thread started meanwhile
    by one not yet set would have inherited the old cores.

    :raises OSError: the cores are not this process's to use.
    """
    done: set[int] = set()
    while True:
        todo = {int(tid) for tid in os.listdir("/proc/self/task")} - done
        if not todo:
            return len(done)
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
            done.add(tid)
