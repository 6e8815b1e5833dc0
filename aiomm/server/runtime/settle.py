"""The uvicorn server of an ``aiomm serve`` process, settled for serving once its app is up.

Two process-wide settings that an app mounted in someone else's server must not make, so they
are made here, by the process that owns the event loop, after the lifespan has opened the engine:

- The loop's thread is declared an asyncio thread to sniffio (``thread_local.name``), when
  sniffio is installed. anyio then asks it which library runs on every call (task groups, cancel
  scopes, ``to_thread``); without the declaration sniffio calls ``asyncio.current_task()``, which
  on Python 3.11 makes a ``getpid`` system call to check the running loop: 1.7% of the event
  loop's GIL-held time under the render benchmark's load (py-spy ``--gil``).
- Everything alive after start-up (torch, transformers, the tokenizer, the engine: ~250,000
  objects) is moved out of the garbage collector's reach (``gc.freeze``). A full collection
  otherwise walks all of it, 0.2-0.3 s with the GIL held, every few thousand requests.
"""

from __future__ import annotations

import gc
import socket

import uvicorn

try:
    import sniffio
except ImportError:  # anyio works without it (and then asks asyncio itself)
    sniffio = None  # type: ignore[assignment]

__all__ = ("ServingServer", "settle_for_serving")


def settle_for_serving() -> None:
    """Declare the calling thread (the event loop's) an asyncio thread to sniffio, and freeze
    the objects alive now out of the garbage collector's generations."""
    if sniffio is not None:
        sniffio.thread_local.name = "asyncio"
    gc.collect()
    gc.freeze()


class ServingServer(uvicorn.Server):
    """``uvicorn.Server`` that calls :func:`settle_for_serving` once its app has started."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.serving()
            settle_for_serving()

    def serving(self) -> None:
        """Called once the app has started and the sockets listen, before the process settles
        (the collection takes up to a second): a subclass announces its readiness here."""
