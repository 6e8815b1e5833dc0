"""The hash stage: encoded bytes or an in-memory image -> a content hash (and RGB pixels).

Input: what the load stage returned. Output: ``(raw, content_hash)`` where ``raw`` is the bytes,
or the in-memory image converted to an ``H x W x 3`` uint8 array once (the transform uses that
array too). Small byte strings are hashed on the event loop (a thread hop costs more); large ones
and every in-memory image in a worker thread, bounded by the stage's own limiter. Videos: their
encoded bytes, or their frames in memory, stacked once into a :class:`~aiomm.video.VideoClip`
and hashed by their pixels.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import numpy as np

from aiomm.decode import image_from_object
from aiomm.hashing import hash_bytes, hash_pixels
from aiomm.video import (
    DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_MAX_VIDEO_FRAMES,
    VideoClip,
    clip_from_frames,
)

from ._stage import Stage

__all__ = ("HashStage",)


def _convert_and_hash(source: Any, max_pixels: int) -> tuple[np.ndarray, str]:
    array = image_from_object(source, max_pixels=max_pixels)
    return array, hash_pixels(array)


def _frames_and_hash(source: Any, max_frames: int, max_bytes: int) -> tuple[VideoClip, str]:
    clip = clip_from_frames(source, max_frames=max_frames, max_bytes=max_bytes)
    return clip, hash_pixels(clip.frames)


class HashStage(Stage):
    """Content hashes: blake3 of encoded bytes, or of an image's RGB pixels."""

    name = "hash"

    def __init__(
        self,
        threads: int,
        *,
        in_thread_bytes: int,
        max_pixels: int,
        max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
        max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
    ) -> None:
        super().__init__(threads)
        self.in_thread_bytes = in_thread_bytes
        self.max_pixels = max_pixels
        self.max_video_frames = max_video_frames
        self.max_video_bytes = max_video_bytes

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

    async def hash_video(self, raw: Any) -> tuple[Any, str]:
        """``(raw or its frames as a VideoClip, content hash)`` of a video.

        :raises InvalidSourceError: frames in memory that are not frames of one size.
        :raises EmptyVideoError, VideoTooLargeError: no frame, or frames beyond the budget.
        """
        if isinstance(raw, (bytes, bytearray, memoryview)):
            return await self.hash(raw)
        with self.counted():
            return await anyio.to_thread.run_sync(
                _frames_and_hash, raw, self.max_video_frames, self.max_video_bytes,
                limiter=self.limiter,
            )  # fmt: skip
