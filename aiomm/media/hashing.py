"""Content hashes and cache keys (blake3, hex).

All functions are synchronous and CPU-bound. blake3 releases the GIL while it hashes (measured: a
second Python thread keeps running during a 64 MiB hash, and 4 threads hash 4 buffers ~2x faster
than one thread on 2 cores), so large inputs should be hashed in a worker thread, where they scale
with the thread pool. Each call uses one hashing thread (``max_threads=1``): parallelism comes from
hashing many items at once, and blake3's own thread pool would oversubscribe the cores.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from blake3 import blake3

__all__ = ("hash_bytes", "hash_pixels", "item_cache_key")


def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    """Return the blake3 hex digest of ``data``."""
    return blake3(data).hexdigest()


def hash_pixels(array: np.ndarray) -> str:
    """Return the blake3 hex digest of an array's values, dtype and shape.

    The memory layout does not matter (a transposed view hashes like its contiguous copy), while
    the same bytes under another shape or dtype hash differently.

    :raises TypeError: for object arrays, whose bytes are pointers rather than values.
    """
    if array.dtype.hasobject:
        raise TypeError(f"cannot hash pixels of dtype {array.dtype}: it holds Python objects")
    # descr keeps byte order and structured field names; the length prefix makes the header
    # unambiguous however it is spelled.
    header = repr((array.dtype.descr, array.shape)).encode()
    hasher = blake3(len(header).to_bytes(8, "little"))
    hasher.update(header)
    # reshape(-1) of a contiguous array is a view; viewing it as uint8 avoids a tobytes() copy.
    # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
    hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return hasher.hexdigest()


def _json_fallback(value: Any) -> Any:
    # Sets iterate in hash order, which varies across processes for str; sort their reprs instead.
    if isinstance(value, (set, frozenset)):
        return sorted(repr(v) for v in value)
    return repr(value)


def item_cache_key(
    content_hash: str,
    *,
    adapter: str,
    processor_kwargs: Mapping[str, Any],
    normalize_mode: str,
) -> str:
    """Return the cache key of one processed item: a blake3 hex over a canonical JSON of all parts.

    Dict ordering does not change the key. Values JSON cannot encode are encoded by ``repr``, so
    they must have a deterministic repr (no memory addresses); tuples encode like lists.
    """
    canonical = json.dumps(
        {
            "adapter": adapter,
            "content": content_hash,
            "kwargs": dict(processor_kwargs),
            "normalize_mode": normalize_mode,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=_json_fallback,
    )
    return blake3(canonical.encode()).hexdigest()
