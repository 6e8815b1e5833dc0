"""Process-wide memory settings for the engine's large, short-lived buffers: glibc's malloc
thresholds, and (for ``aiomm serve``) numpy's huge-page advice (:func:`prefer_small_pages`) and
the item cache's memory faulted in before serving (:func:`pretouch_heap`).

Every image passes through buffers of megabytes (decoded pixels, resized pixels, patch rows, the
merged batch). glibc serves allocations above its mmap threshold with fresh mappings, and the
kernel zero-fills each of their pages on first touch: measured on the streaming benchmark, about a
third of the engine's CPU time went to those page faults. Serving blocks up to 32 MiB from the
heap, and keeping freed memory at the heap's top instead of returning it at once, lets the next
image reuse the last one's memory (benchmark: ~10% more images/s, ~20% fewer page faults).

An embedded engine gives the memory back. Open engines are counted; each process-wide setting an
engine changes registers, once, how to undo it (:func:`undo_on_last_close`). When the last engine
closes, :func:`release_after_last_engine` runs the undos in reverse (Pillow's kept blocks freed
and its limit restored, torch's thread count restored, malloc's thresholds set back) and trims the
heap (``malloc_trim``), so an idle host process shrinks back. What stays: glibc's *dynamic* mmap
threshold, which ``mallopt`` switched off for good (the thresholds return to glibc's initial
values, fixed), memory still referenced by results the caller holds, and arenas of threads that
still exist.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aiomm.logging import get_logger

__all__ = (
    "DEFAULT_MMAP_THRESHOLD",
    "DEFAULT_TRIM_THRESHOLD",
    "engine_opened",
    "prefer_small_pages",
    "pretouch_fits",
    "pretouch_heap",
    "release_after_last_engine",
    "trim_heap",
    "tune_malloc",
    "undo_on_last_close",
    "untune_malloc",
    "use_one_arena",
)

log = get_logger(__name__)

#: glibc's largest allowed mmap threshold on 64-bit systems (HEAP_MAX_SIZE / 2)
DEFAULT_MMAP_THRESHOLD = 32 << 20
#: free memory kept at the top of the heap before it is returned to the system
DEFAULT_TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: blocks :func:`pretouch_heap` touches (below the tuned mmap threshold: they come from the heap)
_PRETOUCH_BLOCK = 16 << 20
#: the share of the host's available memory :func:`pretouch_heap` may take
_PRETOUCH_AVAILABLE_SHARE = 0.8
# glibc's initial values of both thresholds (DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD)
_GLIBC_INITIAL = 128 * 1024

_lock = threading.RLock()
_applied: bool | None = None
_one_arena: bool | None = None
_engines = 0
_undo: dict[str, Callable[[], object]] = {}


def tune_malloc(
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> bool:
    """Apply the settings once per process; True when they are in force.

    Does nothing (False) off Linux, without glibc's ``mallopt``, or when ``GLIBC_TUNABLES``
    already sets malloc options: the operator's choice wins.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        _applied = _apply(mmap_threshold, trim_threshold)
        log.debug("malloc_tuning", applied=_applied, mmap_threshold=mmap_threshold,
                  trim_threshold=trim_threshold)  # fmt: skip
        return _applied


def untune_malloc() -> bool:
    """Set both thresholds back to glibc's initial values if :func:`tune_malloc` changed them;
    True when it did. A later :func:`tune_malloc` applies the settings again."""
    global _applied
    with _lock:
        if not _applied:
            _applied = None
            return False
        _applied = None
        mallopt = _libc_function("mallopt")
        assert mallopt is not None
        mallopt(_M_MMAP_THRESHOLD, _GLIBC_INITIAL)
        mallopt(_M_TRIM_THRESHOLD, _GLIBC_INITIAL)
        return True


def prefer_small_pages() -> None:
    """Stop numpy from asking for transparent huge pages, in this process and the workers it
    starts (which read ``NUMPY_MADVISE_HUGEPAGE`` when they import numpy). ``aiomm serve`` calls
    it; an engine embedded elsewhere leaves its host's numpy as it is.

    numpy advises huge pages for every array of 4 MiB or more. The server makes a few such
    arrays per large image (patch rows, pixels), fills each once and drops or caches it, so each
    huge-page fault zero-fills 2 MiB of memory the kernel had to find as a free 2 MiB block.
    Measured under the render benchmark's load: kernel CPU 0.60 -> 0.39 of the 2 cores, CPU per
    image 4-10% lower (``docs/performance.md``).
    """
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    try:
        # a private numpy function, which numpy's stubs leave out
        from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
    except ImportError:
        try:
            # numpy 1.x (the same function: mypy sees a second definition of the name)
            from numpy.core.multiarray import _set_madvise_hugepage  # type: ignore[no-redef]
        except ImportError:  # gone from a later numpy: its arrays keep its default
            return
    _set_madvise_hugepage(False)


def use_one_arena() -> bool:
    """Limit glibc to one malloc arena, so that threads allocate from the main arena; True when
    the limit was set. For :func:`pretouch_heap`: memory it leaves free in the main arena serves
    only threads allocating from it (each thread otherwise gets an arena of its own). Arenas made
    before the call stay and are still handed to new threads, and glibc ignores the limit once
    it has fixed its own (after eight arenas), so a process calls this before it starts threads
    (a server's worker has one heap then). The limit lasts as long as the process. False off
    glibc, or when ``GLIBC_TUNABLES`` sets malloc options (the operator's choice)."""
    global _one_arena
    with _lock:
        if _one_arena is None:
            mallopt = _libc_function("mallopt")
            _one_arena = (
                mallopt is not None
                and "glibc.malloc." not in os.environ.get("GLIBC_TUNABLES", "")
                and bool(mallopt(_M_ARENA_MAX, 1))
            )
        return _one_arena


def pretouch_heap(nbytes: int) -> int:
    """Fault in ``nbytes`` of heap memory now and leave it free in malloc's main arena; return
    the bytes touched (0: nothing done).

    A server's item cache grows by every new item, and each fresh page is zero-filled by the
    kernel on first touch; on a VM whose host reclaims the guest's free memory (free page
    reporting, ballooning) that first touch costs about 3 ms per MB, measured here: a third of
    the server's CPU while its cache fills. Touching the cache's budget before serving (as the
    JVM's ``-XX:+AlwaysPreTouch`` does for its heap) moves that cost to the start; later
    allocations, the cached items' included, reuse the memory. A small block kept allocated
    above the touched memory keeps glibc from trimming it as the heap's free top; the last
    engine's close frees it and trims the heap (:func:`release_after_last_engine`).

    Does nothing unless the engine's malloc settings are in force (:func:`tune_malloc`: the
    blocks must come from the heap, not from mappings unmapped when freed) and one arena can be
    set (:func:`use_one_arena`), or when ``nbytes`` does not fit the memory left to the process
    (:func:`pretouch_fits`: it would only trade a slow cache for an out-of-memory kill at
    start-up; a warning is logged).
    """
    if nbytes <= 0 or not _applied or not use_one_arena() or not pretouch_fits(nbytes):
        return 0
    malloc, free = _libc_function("malloc"), _libc_function("free")
    realloc = _libc_function("realloc")
    assert malloc is not None and free is not None and realloc is not None
    started = time.perf_counter()
    blocks: list[int] = []
    while len(blocks) * _PRETOUCH_BLOCK < nbytes + _PRETOUCH_BLOCK:  # + the fence
        block = malloc(_PRETOUCH_BLOCK)
        if not block:
            break
        blocks.append(block)
        ctypes.memset(block, 0, _PRETOUCH_BLOCK)
    if not blocks:
        return 0
    # The highest block stays allocated (shrunk) between the rest and the heap's top: free
    # memory that reaches the top is trimmed once it exceeds the trim threshold. glibc shrinks
    # a heap chunk in place, so the fence stays where the block was.
    blocks.sort()
    fence = realloc(blocks.pop(), _ARENA_MARK)
    with _lock:
        _arena_marks.append(fence)
    for block in blocks:
        free(block)
    touched = len(blocks) * _PRETOUCH_BLOCK
    log.info("memory.pretouched", bytes=touched, seconds=round(time.perf_counter() - started, 3))
    return touched


def pretouch_fits(nbytes: int) -> bool:
    """Whether ``nbytes`` is within 80% of the memory this process may still take (the host's
    available memory, or its control group's limit less its use when that is lower); logs a
    warning when it is not. True when neither can be read."""
    available = _mem_available()
    if available is None or nbytes <= available * _PRETOUCH_AVAILABLE_SHARE:
        return True
    log.warning("memory.pretouch_skipped", bytes=nbytes, available_bytes=available)
    return False


def _mem_available() -> int | None:
    found = [v for v in (_host_available(), _cgroup_headroom()) if v is not None]
    return min(found) if found else None


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(root: str = "/sys/fs/cgroup", cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's control group less its use (v2, else v1); None
    without a limit or off Linux."""
    try:
        lines = Path(cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            folder = Path(f"{root}{path}")
            files = (folder / "memory.max", folder / "memory.current")
        elif "memory" in controllers.split(","):  # v1
            folder = Path(f"{root}/memory{path}")
            files = (folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes")
        else:
            continue
        try:
            limit, used = (f.read_text().strip() for f in files)
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for none
                continue
            return max(0, int(limit) - int(used))
        except (OSError, ValueError):
            continue
    return None


def trim_heap() -> bool:
    """Return the heap's free memory to the system (glibc's ``malloc_trim(0)``); True when
    some was returned. False off glibc."""
    malloc_trim = _libc_function("malloc_trim")
    return bool(malloc_trim(0)) if malloc_trim is not None else False


# glibc frees the unused top of a worker thread's arena only from ``free()`` of a block of 64 KiB
# or more in that arena (``heap_trim``), and only down to the trim threshold in force then;
# ``malloc_trim`` does not shrink those arenas. Buffers freed while the threshold was tuned up
# stay mapped, so each worker thread leaves one such block behind (:func:`mark_thread_arena`),
# freed after the thresholds are set back (_ARENA_MARK bytes; on glibc only). The fence of
# :func:`pretouch_heap` is freed with them.
_ARENA_MARK = 64 * 1024
_arena_marks: list[int] = []


def mark_thread_arena() -> None:
    """Called in a worker thread: let the last engine's close give back the memory this
    thread's malloc arena keeps (see :func:`release_after_last_engine`)."""
    malloc = _libc_function("malloc")
    if malloc is None or not _applied:
        return
    block = malloc(_ARENA_MARK)
    if block:
        with _lock:
            _arena_marks.append(block)


def _free_arena_marks() -> None:
    free = _libc_function("free")
    with _lock:
        marks = list(_arena_marks)
        _arena_marks.clear()
    for block in marks:
        free(block)  # type: ignore[misc]


def engine_opened() -> None:
    """Count one more open engine."""
    global _engines
    with _lock:
        _engines += 1


def undo_on_last_close(key: str, undo: Callable[[], object]) -> None:
    """Run ``undo`` when the last open engine closes; the first registration of ``key`` wins (it
    holds the value from before any engine changed the setting)."""
    with _lock:
        _undo.setdefault(key, undo)


def release_after_last_engine() -> bool:
    """Count one engine closed; when it was the last, undo every registered setting (in reverse)
    and trim the heap. True when this was the last engine."""
    global _engines
    with _lock:
        _engines -= 1
        if _engines > 0:
            return False
        _engines = 0
        undos = list(_undo.items())
        _undo.clear()
    for key, undo in reversed(undos):
        try:
            undo()
        except Exception as exc:  # an undo that fails must not keep the others from running
            log.warning("memory.undo_failed", setting=key, error=repr(exc))
    _free_arena_marks()  # after the thresholds are back: each free trims its thread's arena
    trimmed = trim_heap()
    log.debug("memory.released", undone=[k for k, _ in undos], trimmed=trimmed)
    return True


def _libc_function(name: str) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
    except (OSError, AttributeError):  # not glibc (musl has neither mallopt nor malloc_trim)
        return None
    function.restype = ctypes.c_int
    if name == "malloc":
        function.restype = ctypes.c_void_p
        function.argtypes = (ctypes.c_size_t,)
    elif name == "realloc":
        function.restype = ctypes.c_void_p
        function.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    elif name == "free":
        function.restype = None
        function.argtypes = (ctypes.c_void_p,)
    elif name == "mallopt":
        function.argtypes = (ctypes.c_int, ctypes.c_int)
    elif name == "malloc_trim":
        function.argtypes = (ctypes.c_size_t,)
    return function


def _apply(mmap_threshold: int, trim_threshold: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
