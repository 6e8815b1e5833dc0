"""``aiomm serve --workers N``: N server processes, each listening on the port with a socket of
its own (``SO_REUSEPORT``), so that the kernel spreads connections over them.

uvicorn's own supervisor gives every worker one shared listening socket; whichever worker wakes
first accepts, and a burst of new connections (a client pool opening eight at once) can all land
on one worker while the others idle. With a socket per worker the kernel picks a worker for each
connection by a hash of its addresses, so a pool's connections spread over the workers.

The supervisor starts the workers (spawned: each imports the app from ``AIOMM_SERVE_CONFIG``),
starts a worker again when one that was serving dies (one that fails before it serves stops the
server: it would fail again), and on SIGINT / SIGTERM passes SIGTERM to the workers, which drain
their in-flight requests, and waits for them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from aiomm.logging import get_logger

__all__ = ("listening_socket", "run_workers")

log = get_logger(__name__)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not listening yet).

    :raises OSError: the address is taken by a socket without ``SO_REUSEPORT`` or is invalid.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _worker(host: str, port: int, options: dict[str, Any], ready: Any) -> None:
    import uvicorn

    class Worker(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.set()

    sock = listening_socket(host, port)
    config = uvicorn.Config(
        "aiomm.server.serve:app_from_env", factory=True, host=host, port=port, **options
    )
    Worker(config).run(sockets=[sock])


def run_workers(host: str, port: int, workers: int, options: dict[str, Any]) -> int:
    """Run ``workers`` uvicorn servers of ``aiomm.server.serve:app_from_env`` on ``host:port``
    until SIGINT / SIGTERM; return the exit status (1: a worker failed at its start).

    ``options``: uvicorn ``Config`` keywords (picklable) other than the app, host and port.
    """
    # Holding a bound socket of the group reserves the port and fails here, once, when another
    # program has it; it does not listen, so it takes no connections.
    reserved = listening_socket(host, port)
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }

    def start() -> tuple[Any, Any]:
        ready = context.Event()
        process = context.Process(target=_worker, args=(host, port, options, ready))
        process.start()
        return process, ready

    status = 0
    procs = [start() for _ in range(workers)]
    try:
        while not stop.wait(0.25):
            for i, (process, ready) in enumerate(procs):
                if process.is_alive():
                    continue
                if not ready.is_set():
                    # it would fail again (the model, the port): stop instead of a restart loop
                    log.error("worker_failed_at_start", pid=process.pid, code=process.exitcode)
                    status = 1
                    stop.set()
                    break
                log.warning("worker_died", pid=process.pid, code=process.exitcode)
                procs[i] = start()
    finally:
        for process, _ in procs:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        grace = float(options.get("timeout_graceful_shutdown") or 5) + 30
        deadline = time.monotonic() + grace
        for process, _ in procs:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        reserved.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    return status
