"""Unguessable random ids for requests, drawn from the OS a few kilobytes at a time.

``uuid4()`` and ``secrets.token_hex()`` each make a system call, which gives the GIL up: on a
server's event loop that is a wait for a transform thread to hand it back, on every request.
Here one call serves 512 ids of 8 bytes. The bytes are the OS's (``os.urandom``), so the ids stay
as hard to guess as ``secrets``'; a forked child starts from fresh bytes of its own.
"""

from __future__ import annotations

import os
import threading

__all__ = ("random_hex",)

_REFILL_BYTES = 4096
_lock = threading.Lock()
_pool = b""
_at = 0


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes as ``2 * nbytes`` lowercase hex digits."""
    global _pool, _at
    with _lock:
        if _at + nbytes > len(_pool):
            _pool, _at = os.urandom(max(_REFILL_BYTES, nbytes)), 0
        chunk = _pool[_at : _at + nbytes]
        _at += nbytes
    return chunk.hex()


def _forget() -> None:
    """Drop the parent's unused bytes (a forked child must not hand out the same ids)."""
    global _pool, _at
    _pool, _at = b"", 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
