"""EngineConfig: every knob of the engine, frozen, with defaults that suit a serving host."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from aiomm.decode import DecodeConfig
from aiomm.fetch import FetchConfig
from aiomm.processing.processor import MultiModalConfig

__all__ = ("EngineConfig",)

VisualDtype = Literal["bfloat16", "float16", "float32"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of an :class:`~aiomm.Engine`.

    Every queue and pool is bounded by one of these fields; none is unbounded.
    """

    #: worker threads for decode + resize + patchify (GIL-releasing work): one per core
    transform_threads: int = field(default_factory=_cores)
    #: concurrent downloads
    fetch_concurrency: int = 32
    #: requests admitted into the pipeline at once (``process`` calls and ``stream`` slots)
    max_in_flight: int = 64
    #: decoded image bytes (H*W*3 of the source) admitted at once; a single larger image is
    #: still admitted alone, so nothing starves
    max_decoded_bytes_in_flight: int = 1 << 30
    #: in-process cache of per-item outputs, bounded in bytes; 0 disables caching
    cache_capacity_bytes: int = 4 << 30
    #: dtype of the normalised ``pixel_values`` handed to the model
    visual_dtype: VisualDtype = "bfloat16"
    #: "auto" = CUDA when available, else CPU
    device: str = "auto"
    #: pinned host staging buffers for uint8 H2D copies (also the device stage's concurrency)
    device_staging_buffers: int = 4
    #: initial size of each staging buffer; grown (powers of two) up to the maximum below
    device_staging_buffer_bytes: int = 16 << 20
    device_staging_max_buffer_bytes: int = 256 << 20
    #: on a CPU device: idle memory kept to back the next results (fresh pages for each
    #: request's tens of megabytes cost a fifth of the CPU; see ``aiomm.host_buffers``); 0 = off
    host_output_pool_bytes: int = 256 << 20
    #: intra-op threads of torch, set once when the engine opens (None: leave the process
    #: setting alone). Workers already run in parallel; 1 avoids oversubscribing the cores.
    torch_threads: int | None = None
    #: resize + patchify on the device (bit-exact to the CPU path): the CPU only decodes.
    #: None = on when the device is CUDA and the adapter's transform is a plain resize.
    mm_device_resize: bool | None = None
    #: let glibc's malloc reuse the large per-image buffers instead of mapping fresh pages for
    #: each (process-wide, once; see ``aiomm.memory``); skipped when ``GLIBC_TUNABLES`` sets
    #: malloc options
    tune_malloc: bool = True
    #: hash encoded bytes in a worker thread above this size (below it the loop is faster)
    hash_in_thread_bytes: int = 1 << 20
    fetch: FetchConfig = field(default_factory=FetchConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    processing: MultiModalConfig = field(default_factory=MultiModalConfig)

    def pillow_blocks_kept(self) -> int:
        """Pillow memory blocks the engine keeps for reuse (``decode.pillow_blocks_kept``)."""
        kept = self.decode.pillow_blocks_kept
        return 4 * self.transform_threads if kept is None else kept

    def __post_init__(self) -> None:
        for name in (
            "transform_threads",
            "fetch_concurrency",
            "max_in_flight",
            "device_staging_buffers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.max_decoded_bytes_in_flight < 1:
            raise ValueError("max_decoded_bytes_in_flight must be positive")
        if self.host_output_pool_bytes < 0:
            raise ValueError("host_output_pool_bytes must be >= 0")
        if self.cache_capacity_bytes < 0:
            raise ValueError("cache_capacity_bytes must be >= 0")
        if self.visual_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"visual_dtype={self.visual_dtype!r} is not bfloat16/float16/float32")
