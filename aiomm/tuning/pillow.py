"""Pillow's block cache: freed image-memory blocks kept for reuse, process-wide.

Without kept blocks every decode maps fresh memory that the kernel zero-fills page by page, about
a fifth of a JPEG decode on the development machine. An engine raises Pillow's limit only when
``DecodeConfig.pillow_blocks_kept`` asks (``aiomm serve`` and ``aiomm run`` do, through
:func:`aiomm.tuning.tuned`); the last engine to close puts it back (:mod:`.malloc`).
"""

from __future__ import annotations

import PIL.Image

__all__ = ("keep_pillow_blocks", "pillow_blocks_limit", "release_pillow_blocks")


def keep_pillow_blocks(blocks: int) -> int:
    """Let Pillow keep up to ``blocks`` freed image-memory blocks for reuse (process-wide).

    Raises Pillow's limit to ``blocks`` and never lowers it (another engine, or the
    ``PILLOW_BLOCKS_MAX`` environment variable, may have asked for more). Returns the limit now
    in force; :func:`release_pillow_blocks` with the limit from before undoes it.
    """
    core = PIL.Image.core
    current = pillow_blocks_limit()
    if blocks > current:
        core.set_blocks_max(blocks)
        current = blocks
    return current


def pillow_blocks_limit() -> int:
    """How many freed image-memory blocks Pillow keeps at most now."""
    return int(PIL.Image.core.get_blocks_max())


def release_pillow_blocks(blocks_max: int) -> None:
    """Free the blocks Pillow keeps and set its limit back to ``blocks_max``."""
    core = PIL.Image.core
    core.set_blocks_max(blocks_max)
    core.clear_cache()
