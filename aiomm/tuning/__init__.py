"""Every setting aiomm can change for its whole process, in one place to audit.

An :class:`~aiomm.Engine` embedded in a host application changes none of them unless its
configuration asks; a program that owns its process (``aiomm serve``, ``aiomm run``, the
benchmarks) asks for the ones measured worth it with :func:`tuned`:

- glibc's malloc thresholds (``EngineConfig.tune_malloc``, :mod:`.malloc`);
- torch's intra-op threads (``EngineConfig.torch_threads``);
- Pillow's block cache (``DecodeConfig.pillow_blocks_kept``, :mod:`.pillow`).

``aiomm serve`` further settles its process (a frozen GC, numpy's small pages:
``aiomm.server.runtime.settle``) and may fault in its cache budget (``--cache-pretouch``,
:func:`.malloc.pretouch_heap`). The last engine to close undoes what the engines set.
"""

from __future__ import annotations

from dataclasses import replace

from aiomm.config import EngineConfig

__all__ = ("tuned",)


def tuned(config: EngineConfig | None = None) -> EngineConfig:
    """``config`` (default: ``EngineConfig()``) with every process-wide setting aiomm measured
    worth it, for a program that owns its process: malloc tuning, one torch thread when several
    transform threads run, four Pillow blocks kept per transform thread. Fields the caller set
    explicitly (a ``torch_threads``, a ``pillow_blocks_kept``) are kept."""
    config = config or EngineConfig()
    decode = config.decode
    if decode.pillow_blocks_kept is None:
        decode = replace(decode, pillow_blocks_kept=4 * config.transform_threads)
    torch_threads = config.torch_threads
    if torch_threads is None and config.transform_threads > 1:
        torch_threads = 1
    return replace(config, tune_malloc=True, torch_threads=torch_threads, decode=decode)
