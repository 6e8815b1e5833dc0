"""A cache tier shared by the worker processes of one host (``aiomm serve --workers N``).

Without it each worker caches only what it computed itself, so an image that comes back on
another worker's connection is computed again: with N workers, a repeat finds its item only once
in N times. With it, a worker that misses asks the worker that computed the item for a copy,
which costs a few copies of the item's bytes instead of a decode, resize and patch layout. The
first copy of an item serves that request and is dropped (:meth:`PeerItemCache.store_hit`): the
owner keeps it, so the workers' caches, which share one budget (``aiomm serve --cache-gb``),
hold such an item once; an item a worker reads a second time is kept there too.

The tier needs no server of its own. Every worker listens on a Unix socket in one private
directory (``w<pid>-<random>.sock``), and announces each item it computed with a symbolic link
named after the item's key (``i<digest>``) that points at its socket; replacing a link is
atomic. A worker that misses reads the link, connects to the owner's socket, sends the key and
reads the item in :mod:`aiomm.cache.codec`'s format (its digest checked). Anything that goes
wrong (no link, the owner gone or slow, the item evicted there, a damaged reply) means the item
is computed here, as without the tier; nothing waits for another worker's computation in flight.

Each worker removes the links it made when it closes, and its oldest links beyond
``max_links``; a link whose owner no longer holds the item is removed when a peer asks for it.
A worker killed outright leaves its socket and links behind: a peer's fetch through one of them
fails (counted in ``errors``), and the item is computed and announced again by that peer.

The folder must belong to the server's user and be closed to others (mode 700): whoever can
create links in it could hand the workers items of their own (the digest detects damage, not
the sender). Fetches and the peers' requests served are each bounded (four at a time per
worker), and a fetch by ``timeout_s`` as a whole.

Runs on the event loop of an anyio app; peers are served from a thread of its own (one per
connection), which looks items up on the loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np
from blake3 import blake3

from aiomm.cache.codec import (
    ITEM_ALIGN,
    ITEM_PREFIX_BYTES,
    decode_item,
    encode_item_parts,
    item_header_bytes,
)
from aiomm.errors import CacheValueError, ConfigError
from aiomm.logging import get_logger
from aiomm.processing.fields import MultiModalKwargsItem

__all__ = ("PeerCacheStatistics", "PeerItemCache")

log = get_logger(__name__)

#: how the tier obtained an item (the second-tier protocol of :mod:`aiomm.cache.item_cache`)
PeerOutcome = Literal["hit", "computed"]

_KEY_LEN = struct.Struct("<I")
_REPLY = struct.Struct("<BQ")  # found (0/1), item bytes that follow
_SOCKET_NAME = re.compile(r"w[0-9]+-[0-9a-f]{8}\.sock")
_MAX_KEY_BYTES = 1 << 16
# fetches this worker makes at once, and peers' requests it serves at once
_CONCURRENT = 4
# A link younger than this may name an item its owner is still storing: not removed on a miss.
_LINK_GRACE_S = 2.0


@dataclass(frozen=True)
class PeerCacheStatistics:
    """A snapshot of a :class:`PeerItemCache`."""

    #: items read from another worker
    hits: int
    #: local misses with no link, or whose owner no longer had the item
    misses: int
    #: fetches that failed (owner gone, timeout, damaged reply); the item was computed here
    errors: int
    #: items this worker sent to its peers
    served: int
    #: requests from peers for items this worker no longer holds
    served_misses: int
    bytes_read: int
    bytes_written: int
    #: links this worker holds now
    links: int


class PeerItemCache:
    """The worker-to-worker tier; see the module docstring.

    :param directory: the directory every worker of the host shares (private to the server's
        user; ``aiomm serve --workers N`` makes one on tmpfs).
    :param timeout_s: bound on a fetch, from the connection to the last byte.
    :param max_item_bytes: larger replies are refused (the item is computed here).
    :param max_links: links kept beyond this many are removed, oldest first.
    """

    #: keys read from a peer and not kept, remembered so that a second read of one keeps it
    _READ_ONCE_KEPT = 1 << 14

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        timeout_s: float = 2.0,
        max_item_bytes: int = 256 << 20,
        max_links: int = 1 << 16,
    ) -> None:
        self.directory = Path(directory)
        # links are made and read once or twice per item on the event loop: plain strings, not
        # Path objects
        self._prefix = os.path.join(self.directory, "")
        self.timeout_s = timeout_s
        self.max_item_bytes = max_item_bytes
        self.max_links = max_links
        # unique per tier, not per process: several engines of one process may share a folder
        self.socket_name = f"w{os.getpid()}-{secrets.token_hex(4)}.sock"
        self._lookup: Callable[[str], MultiModalKwargsItem | None] | None = None
        self._token: Any = None
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None
        self._links: OrderedDict[str, float] = OrderedDict()  # link name -> when made
        self._read_once: OrderedDict[str, None] = OrderedDict()
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "errors",
                "served",
                "served_misses",
                "bytes_read",
                "bytes_written",
            ),
            0,
        )
        self._lock = threading.Lock()  # the serving threads' counters
        self._fetches = anyio.CapacityLimiter(_CONCURRENT)  # not the default thread pool's
        self._serving = threading.BoundedSemaphore(_CONCURRENT)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, lookup: Callable[[str], MultiModalKwargsItem | None]) -> None:
        """Listen for peers; ``lookup`` (called on this event loop) finds an item held here.

        :raises ConfigError: the directory is missing or not private, or the socket cannot be
            bound.
        """
        if self._server is not None:
            raise RuntimeError("PeerItemCache.start was already called")
        self._lookup = lookup
        self._token = anyio.lowlevel.current_token()
        path = self.directory / self.socket_name
        tier = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                tier._serve_one(self.request)

        class Server(socketserver.ThreadingUnixStreamServer):
            # socketserver's default of 5 refuses a burst of peers' misses at once (EAGAIN)
            request_queue_size = socket.SOMAXCONN

        try:
            _check_private(self.directory)
            server = Server(str(path), Handler)
        except OSError as exc:
            raise ConfigError(
                f"EngineConfig.peer_cache_dir {str(self.directory)!r} cannot be served: {exc}"
            ) from exc
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="aiomm-peers",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        log.info("peer_cache_ready", directory=str(self.directory), socket=self.socket_name)

    async def aclose(self) -> None:
        """Stop serving peers and remove this worker's socket and links."""
        with anyio.CancelScope(shield=True):  # a cancelled close still cleans up
            server, self._server = self._server, None
            if server is not None:
                await anyio.to_thread.run_sync(server.shutdown)
                server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=1.0)
                self._thread = None
            with contextlib.suppress(FileNotFoundError):
                (self.directory / self.socket_name).unlink()
            for name in list(self._links):
                self._unlink_own(name)
            self._links.clear()

    # -- the second-tier protocol ------------------------------------------------------------

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[MultiModalKwargsItem]]
    ) -> tuple[MultiModalKwargsItem, PeerOutcome]:
        """The item of ``key`` from the worker that announced it, else from ``compute`` (then
        announced as this worker's).

        The tier's own failures never reach the caller.

        :raises: whatever ``compute`` raised.
        """
        name = self.link_name(key)
        owner = self._owner(name)
        if owner is not None:
            try:
                item = await anyio.to_thread.run_sync(
                    self._fetch, owner, key, limiter=self._fetches
                )
            except Exception as exc:  # whatever it was, the item is computed here
                self._counts["errors"] += 1
                log.debug("peer_fetch_failed", owner=owner, error=f"{type(exc).__name__}: {exc}")
                item = None
            if item is not None:
                self._counts["hits"] += 1
                return item, "hit"
        self._counts["misses"] += 1
        item = await compute()
        if self._server is not None:
            self._announce(name)
        return item, "computed"

    def store_hit(self, key: str) -> bool:
        """Whether the item of ``key`` just read from a peer is cached here too: from its second
        read on. A copy read once serves that request and is dropped (the owner keeps it, and
        the workers' caches, which share one budget, hold it once); an item this worker keeps
        asking for is worth its memory here."""
        if key in self._read_once:
            del self._read_once[key]
            return True
        self._read_once[key] = None
        if len(self._read_once) > self._READ_ONCE_KEPT:
            self._read_once.popitem(last=False)
        return False

    def statistics(self) -> PeerCacheStatistics:
        """Return a snapshot of the counters."""
        with self._lock:
            counts = dict(self._counts)
        return PeerCacheStatistics(links=len(self._links), **counts)

    @staticmethod
    def link_name(key: str) -> str:
        """The file name of the link that announces ``key``."""
        return "i" + blake3(key.encode()).hexdigest(length=20)

    # -- links ---------------------------------------------------------------------------------

    def _owner(self, name: str) -> str | None:
        """The socket file of another live worker named by the link ``name``, or None."""
        try:
            target = os.readlink(self._prefix + name)
        except OSError:
            return None
        if target == self.socket_name or not _SOCKET_NAME.fullmatch(target):
            return None
        return target

    def _announce(self, name: str) -> None:
        tmp = f"{self._prefix}.{name}.{self.socket_name}"
        try:
            try:
                os.symlink(self.socket_name, tmp)
            except FileExistsError:  # left by an announcement that failed half-way
                os.unlink(tmp)
                os.symlink(self.socket_name, tmp)
            os.replace(tmp, self._prefix + name)  # atomic, even over another worker's link
        except OSError as exc:
            log.debug("peer_announce_failed", error=f"{type(exc).__name__}: {exc}")
            return
        self._links[name] = time.monotonic()
        self._links.move_to_end(name)
        while len(self._links) > self.max_links:
            old, _ = self._links.popitem(last=False)
            self._unlink_own(old)

    def _unlink_own(self, name: str) -> None:
        """Remove the link ``name`` if it still names this worker (another may have replaced
        it since; between the check and the removal a replacement is lost, which only costs a
        recomputation)."""
        path = self._prefix + name
        try:
            if os.readlink(path) == self.socket_name:
                os.unlink(path)
        except OSError:
            pass

    # -- fetching (a worker thread) ----------------------------------------------------------

    def _fetch(self, owner: str, key: str) -> MultiModalKwargsItem | None:
        """Ask ``owner`` for ``key``: the item, or None when the owner no longer holds it."""
        deadline = time.monotonic() + self.timeout_s
        raw = key.encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout_s)
            sock.connect(str(self.directory / owner))
            sock.sendall(_KEY_LEN.pack(len(raw)) + raw)
            found, size = _REPLY.unpack(_recv_into(sock, bytearray(_REPLY.size), deadline))
            if not found:
                return None
            if not ITEM_PREFIX_BYTES <= size <= self.max_item_bytes:
                raise CacheValueError(
                    f"a peer offered {size} bytes (max_item_bytes {self.max_item_bytes})"
                )
            prefix = _recv_into(sock, bytearray(ITEM_PREFIX_BYTES), deadline)
            # the tensors will view this buffer: place the payload on a 64-byte boundary, as
            # the format lays out its tensors (a copy would be aligned by the allocator)
            head = ITEM_PREFIX_BYTES + item_header_bytes(prefix)
            buf = np.empty(size + ITEM_ALIGN, np.uint8)  # not zero-filled: it is received into
            pad = -(buf.ctypes.data + head) % ITEM_ALIGN
            # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
            view = memoryview(buf)[pad : pad + size]  # type: ignore[arg-type]
            view[:ITEM_PREFIX_BYTES] = prefix
            _recv_into(sock, view[ITEM_PREFIX_BYTES:], deadline)
        with self._lock:
            self._counts["bytes_read"] += size
        return decode_item(view, take=True)

    # -- serving (the server's threads) --------------------------------------------------------

    def _serve_one(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        if not self._serving.acquire(timeout=self.timeout_s):
            return  # busy: the peer's fetch fails and it computes the item itself
        try:
            self._serve_held(sock)
        finally:
            self._serving.release()

    def _serve_held(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            (length,) = _KEY_LEN.unpack(_recv_into(sock, bytearray(_KEY_LEN.size), deadline))
            if length > _MAX_KEY_BYTES:
                return
            key = bytes(_recv_into(sock, bytearray(length), deadline)).decode()
            item = self._held(key)
            parts = None
            if item is not None:
                try:
                    parts = encode_item_parts(item)
                except CacheValueError:
                    parts = None  # a value the format cannot hold: the peer computes it
            if parts is None:
                with self._lock:
                    self._counts["served_misses"] += 1
                sock.sendall(_REPLY.pack(0, 0))
                return
            # sent part by part from the item's own memory: no joined copy of megabytes
            size = sum(memoryview(part).nbytes for part in parts)
            sock.sendall(_REPLY.pack(1, size))
            for part in parts:
                sock.sendall(part)
            with self._lock:
                self._counts["served"] += 1
                self._counts["bytes_written"] += size
        except Exception as exc:  # one peer's request: never the serving thread's end
            log.debug("peer_serve_failed", error=f"{type(exc).__name__}: {exc}")

    def _held(self, key: str) -> MultiModalKwargsItem | None:
        """The item of ``key`` held here (looked up on the event loop), or None; a link of
        ours that names an item no longer held is removed."""
        lookup = self._lookup
        if lookup is None:
            return None
        try:
            return anyio.from_thread.run_sync(self._held_on_loop, key, token=self._token)
        except Exception:  # the loop is closing, or the lookup failed: the peer computes it
            return None

    def _held_on_loop(self, key: str) -> MultiModalKwargsItem | None:
        assert self._lookup is not None
        item = self._lookup(key)
        if item is None:
            name = self.link_name(key)
            made = self._links.get(name)
            if made is not None and time.monotonic() - made > _LINK_GRACE_S:
                del self._links[name]
                self._unlink_own(name)
        return item


def _recv_into(
    sock: socket.socket, buf: bytearray | memoryview, deadline: float
) -> bytearray | memoryview:
    """Fill ``buf`` from ``sock`` before ``deadline`` (``time.monotonic``); return it.

    :raises TimeoutError: the deadline passed first.
    :raises ConnectionError: the peer closed the connection first.
    """
    view = memoryview(buf).cast("B")
    got, size = 0, len(view)
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"peer sent {got} of {size} bytes in time")
        sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += n
    return buf


def _check_private(directory: Path) -> None:
    """Refuse a folder that another user owns or may write in: whoever can create links there
    could hand this worker items of its own.

    :raises PermissionError: the folder is not private to this user.
    """
    info = directory.stat()
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{directory} must belong to this user and be closed to others (mode 700), it has "
            f"uid {info.st_uid} and mode {info.st_mode & 0o777:o}"
        )
