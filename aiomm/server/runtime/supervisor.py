"""``aiomm serve --workers N``: N server processes, each listening on the port with a socket of
its own (``SO_REUSEPORT``), so that the kernel spreads connections over them.

uvicorn's own supervisor gives every worker one shared listening socket; whichever worker wakes
first accepts, and a burst of new connections (a client pool opening eight at once) can all land
on one worker while the others idle. With a socket per worker the kernel picks a worker for each
connection by a hash of its addresses, so a pool's connections spread over the workers; a hash
can still give one worker more than its share of a few long-lived connections, so the workers
even them out at request boundaries (:mod:`.balance`).

The supervisor starts the workers (spawned: each imports the app from ``AIOMM_SERVE_CONFIG``)
and starts a worker again when one dies, pausing longer each time one keeps dying; a worker that
fails at the server's start, before it serves, stops the server (every one would fail again).
On SIGINT / SIGTERM it passes SIGTERM to the workers, which drain their in-flight requests, and
waits for them. A worker also ends when the supervisor dies, however it dies (Linux).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiomm.logging import get_logger
from aiomm.server.runtime import balance as connection_balance
from aiomm.server.runtime.balance import NOT_SERVING, ConnectionBalance
from aiomm.server.runtime.pinning import pin_process, worker_cpus

__all__ = ("ListenError", "listening_socket", "run_workers")

log = get_logger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: the longest pause before a worker that keeps dying is started again
_MAX_RESTART_DELAY_S = 30.0
#: a worker serving this long has its restart pause reset
_STABLE_S = 60.0


class ListenError(RuntimeError):
    """The server's address cannot be listened on (taken, or invalid)."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not listening yet).

    :raises OSError: the address is taken by a socket without ``SO_REUSEPORT`` or is invalid.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _check_free(host: str, port: int) -> None:
    """Fail unless ``host:port`` is free: a plain bind conflicts with any listener and with any
    ``SO_REUSEPORT`` group, another server of this user's included (which a group socket would
    join, sharing its connections); connections in TIME_WAIT do not count.

    :raises ListenError: the address is taken or invalid.
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ListenError(f"cannot listen on {host}:{port}: {exc}") from exc


def _end_with_parent(parent: int) -> None:
    """Ask Linux to send this process SIGTERM when the supervisor dies (even by SIGKILL), so no
    worker is left serving alone; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _worker(
    host: str,
    port: int,
    options: dict[str, Any],
    ready: Any,
    parent: int,
    counts: Any,
    index: int,
    cpus: frozenset[int] | None,
) -> None:
    import uvicorn

    _end_with_parent(parent)
    balance = ConnectionBalance(counts, index)
    connection_balance.install(balance)

    from aiomm.server.runtime.settle import ServingServer

    class Worker(ServingServer):
        def serving(self) -> None:
            if cpus is not None:
                # once started: the start-up (the model, the cache's pretouch) uses every core
                threads = pin_process(cpus)
                log.info("worker_pinned", cpus=sorted(cpus), threads=threads)
            balance.serving()
            ready.set()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            balance.serving(False)
            await super().shutdown(sockets)

    sock = listening_socket(host, port)
    config = uvicorn.Config(
        "aiomm.server.serve:app_from_env", factory=True, host=host, port=port, **options
    )
    Worker(config).run(sockets=[sock])


def run_workers(
    host: str, port: int, workers: int, options: dict[str, Any], *, pin: bool = False
) -> int:
    """Run ``workers`` uvicorn servers of ``aiomm.server.serve:app_from_env`` on ``host:port``
    until SIGINT / SIGTERM; return the exit status (1: a worker failed at the server's start).

    ``options``: uvicorn ``Config`` keywords (picklable) other than the app, host and port. A
    worker that dies later is started again, after a pause that doubles (up to
    ``_MAX_RESTART_DELAY_S``) while its replacements keep dying soon after they start.
    ``pin``: each worker (and its replacements) runs on its own share of the cores this process
    may use (:mod:`.pinning`), from when it serves.

    :raises ListenError: the address is taken or invalid.
    """
    _check_free(host, port)
    # A group socket that does not listen (so it takes no connections) keeps programs without
    # SO_REUSEPORT off the port while the workers start; one that sets SO_REUSEPORT could still
    # bind meanwhile, and the workers would then fail at their start.
    try:
        reserved = listening_socket(host, port)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc}") from exc
    context = multiprocessing.get_context("spawn")
    # A flag, not a threading.Event: setting an Event from a signal handler can deadlock on
    # the lock its wait() holds in the same thread.
    stopping: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }

    @dataclass
    class Slot:
        index: int
        process: Any = None
        ready: Any = None
        first: bool = True  # the server's start: a failure there stops the server
        delay: float = 0.0  # the pause before the next restart
        restart_at: float | None = None
        ready_since: float | None = None

    # each worker's open connections (NOT_SERVING while it does not serve): the workers even
    # them out (balance)
    counts = context.RawArray("q", [NOT_SERVING] * workers)
    shares = worker_cpus(os.sched_getaffinity(0), workers) if pin else None

    def start(slot: Slot) -> None:
        slot.ready = context.Event()
        slot.process = context.Process(
            target=_worker,
            args=(
                host,
                port,
                options,
                slot.ready,
                os.getpid(),
                counts,
                slot.index,
                None if shares is None else shares[slot.index],
            ),
        )
        slot.restart_at = slot.ready_since = None
        slot.process.start()

    status = 0
    slots = [Slot(i) for i in range(workers)]
    try:
        for slot in slots:
            start(slot)
        while not stopping:
            time.sleep(0.25)
            now = time.monotonic()
            for slot in slots:
                if slot.restart_at is not None:
                    if now >= slot.restart_at:
                        start(slot)
                    continue
                if slot.process.is_alive():
                    if slot.ready.is_set() and slot.ready_since is None:
                        slot.ready_since, slot.first = now, False
                    if slot.ready_since is not None and now - slot.ready_since > _STABLE_S:
                        slot.delay = 0.0
                    continue
                code = slot.process.exitcode
                if slot.first and not slot.ready.is_set():
                    # the model or the port: every worker would fail the same way
                    log.error("worker_failed_at_start", pid=slot.process.pid, code=code)
                    status = 1
                    stopping.append(0)
                    break
                counts[slot.index] = NOT_SERVING  # its connections died with it
                log.warning("worker_died", pid=slot.process.pid, code=code, restart_in=slot.delay)
                slot.restart_at = now + slot.delay
                slot.delay = min(_MAX_RESTART_DELAY_S, max(1.0, 2 * slot.delay))
    finally:
        running = [s.process for s in slots if s.process is not None and s.restart_at is None]
        for process in running:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        grace = float(options.get("timeout_graceful_shutdown") or 5) + 30
        deadline = time.monotonic() + grace
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        reserved.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    return status
