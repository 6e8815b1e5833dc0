"""The hash stage: encoded bytes or an in-memory image -> a content hash (and RGB pixels).

Input: what the load stage returned. Output: ``(raw, content_hash)`` where ``raw`` is the bytes,
or the in-memory image converted to an ``H x W x 3`` uint8 array once (the transform uses that
array too). Small byte strings are hashed on the event loop (a thread hop costs more); large ones
and every in-memory image in a worker thread, bounded by the stage's own limiter.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import numpy as np

from aiomm.decode import image_from_object
from aiomm.hashing import hash_bytes, hash_pixels

from ._stage import Stage

__all__ = ("HashStage",)


def _convert_and_hash(source: Any, max_pixels: int) -> tuple[np.ndarray, str]:
    array = image_from_object(source, max_pixels=max_pixels)
    return array, hash_pixels(array)


class HashStage(Stage):
    """Content hashes: blake3 of encoded bytes, or of an image's RGB pixels."""

    name = "hash"

    def __init__(self, threads: int, *, in_thread_bytes: int, max_pixels: int) -> None:
        super().__init__(threads)
        self.in_thread_bytes = in_thread_bytes
        self.max_pixels = max_pixels

    async def hash(self, raw: Any) -> tuple[Any, str]:
        """``(raw or its RGB array, content hash)``.

        :raises DecodeError: an in-memory image that cannot be converted to RGB.
        :raises ImageTooLargeError: an in-memory image of more than ``max_pixels`` pixels.
        """
        with self.counted():
            if isinstance(raw, (bytes, bytearray, memoryview)):
                if len(raw) < self.in_thread_bytes:
                    return raw, hash_bytes(raw)
                digest = await anyio.to_thread.run_sync(hash_bytes, raw, limiter=self.limiter)
                return raw, digest
            return await anyio.to_thread.run_sync(
                _convert_and_hash, raw, self.max_pixels, limiter=self.limiter
            )
