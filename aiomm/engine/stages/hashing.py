"""The hash stage: encoded bytes or an in-memory item -> the item's id (and RGB pixels).

Input: what the load stage returned. Output: ``(raw, item_id)`` where ``raw`` is the bytes, or
the in-memory image converted to an ``H x W x 3`` uint8 array once (the transform uses that
array too). Encoded bytes are identified by the engine's :class:`Hasher` (by default
:class:`ContentHasher`, blake3 of the bytes; the render server's is vLLM's mm_hash); in-memory
images and frames by the blake3 of their pixels. Small byte strings are hashed on the event loop
(a thread hop costs more); large ones, every video and every in-memory image in a worker thread,
bounded by the stage's own limiter. Videos in memory are stacked once into a
:class:`~aiomm.media.video.VideoClip`. An audio's encoded bytes are identified by the hasher's
``hash_audio`` before any decode (a cache hit skips the decode), unless the hasher identifies
decoded audio (it defines ``hash_waveform``, as vLLM's mm_hash does): the bytes are then decoded
and resampled here, in a worker thread, and the waveform goes on to the transform. Audio samples
in memory are resampled here and identified by ``hash_waveform``, else by the blake3 of the
waveform.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import anyio.to_thread
import numpy as np

from aiomm.engine._audio import AudioLoader, Waveform
from aiomm.errors import UnknownModalityError
from aiomm.media.hashing import hash_bytes, hash_pixels
from aiomm.media.image import image_from_object
from aiomm.media.video import (
    DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_MAX_VIDEO_FRAMES,
    VideoClip,
    clip_from_frames,
)

from ._stage import Stage

__all__ = ("ContentHasher", "HashStage", "Hasher")


class Hasher(Protocol):
    """How an engine identifies an item given as encoded bytes: the id its result reports
    (``Result.item_ids``) and its cache entry is keyed by. Called in worker threads."""

    def hash_image(self, data: bytes) -> str:
        """The id of an image's encoded bytes.

        :raises MediaError: bytes the hasher cannot identify (a 4xx through the server).
        """
        ...

    def hash_video(self, data: bytes) -> str:
        """The id of a video's encoded bytes.

        :raises MediaError: bytes the hasher cannot identify.
        """
        ...

    def hash_audio(self, data: bytes) -> str:
        """The id of an audio's encoded bytes (not called when the hasher defines
        ``hash_waveform(samples) -> str``, the id of the decoded, resampled waveform).

        :raises MediaError: bytes the hasher cannot identify.
        """
        ...


class ContentHasher:
    """The default :class:`Hasher`: blake3 of the encoded bytes, images and videos alike."""

    def hash_image(self, data: bytes) -> str:
        return hash_bytes(data)

    def hash_video(self, data: bytes) -> str:
        return hash_bytes(data)

    def hash_audio(self, data: bytes) -> str:
        return hash_bytes(data)


def _convert_and_hash(source: Any, max_pixels: int) -> tuple[np.ndarray, str]:
    array = image_from_object(source, max_pixels=max_pixels)
    return array, hash_pixels(array)


def _frames_and_hash(source: Any, max_frames: int, max_bytes: int) -> tuple[VideoClip, str]:
    clip = clip_from_frames(source, max_frames=max_frames, max_bytes=max_bytes)
    return clip, hash_pixels(clip.frames)


class HashStage(Stage):
    """Item ids: the :class:`Hasher`'s of encoded bytes, blake3 of an in-memory image's RGB
    pixels."""

    name = "hash"

    def __init__(
        self,
        threads: int,
        *,
        in_thread_bytes: int,
        max_pixels: int,
        max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
        max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
        hasher: Hasher | None = None,
        audio: AudioLoader | None = None,
    ) -> None:
        super().__init__(threads)
        #: loads audio items (None: the adapter takes no audio)
        self.audio = audio
        self.hasher: Hasher = hasher or ContentHasher()
        self.in_thread_bytes = in_thread_bytes
        self.max_pixels = max_pixels
        self.max_video_frames = max_video_frames
        self.max_video_bytes = max_video_bytes

    async def hash(self, raw: Any) -> tuple[Any, str]:
        """``(raw or its RGB array, item id)``.

        :raises DecodeError: an in-memory image that cannot be converted to RGB.
        :raises ImageTooLargeError: an in-memory image of more than ``max_pixels`` pixels.
        :raises MediaError: encoded bytes the hasher refuses.
        """
        with self.counted():
            if isinstance(raw, (bytes, bytearray, memoryview)):
                # encoded bytes, as Fetcher.fetch returns them (Hasher takes bytes)
                data = cast(bytes, raw)
                if len(raw) < self.in_thread_bytes:
                    return raw, self.hasher.hash_image(data)
                digest = await anyio.to_thread.run_sync(
                    self.hasher.hash_image, data, limiter=self.limiter
                )
                return raw, digest
            return await anyio.to_thread.run_sync(
                _convert_and_hash, raw, self.max_pixels, limiter=self.limiter
            )

    async def hash_video(self, raw: Any) -> tuple[Any, str]:
        """``(raw or its frames as a VideoClip, item id)`` of a video.

        :raises InvalidSourceError: frames in memory that are not frames of one size.
        :raises EmptyVideoError, VideoTooLargeError: no frame, or frames beyond the budget.
        :raises MediaError: encoded bytes the hasher refuses.
        """
        with self.counted():
            if isinstance(raw, (bytes, bytearray, memoryview)):
                # encoded bytes, as Fetcher.fetch returns them (Hasher takes bytes)
                digest = await anyio.to_thread.run_sync(
                    self.hasher.hash_video, cast(bytes, raw), limiter=self.limiter
                )
                return raw, digest
            return await anyio.to_thread.run_sync(
                _frames_and_hash, raw, self.max_video_frames, self.max_video_bytes,
                limiter=self.limiter,
            )  # fmt: skip

    async def hash_audio(self, raw: Any) -> tuple[Any, str]:
        """``(raw or its :class:`~aiomm.engine._audio.Waveform`, item id)`` of an audio: encoded
        bytes stay bytes unless the hasher identifies waveforms; samples in memory become the
        resampled waveform.

        :raises UnknownModalityError: the adapter takes no audio.
        :raises DecodeError: audio that cannot be decoded within the limits (when decoded here).
        :raises InvalidSourceError: an in-memory item that is not ``(samples, rate)``.
        :raises MediaError: encoded bytes the hasher refuses.
        """
        audio = self.audio
        if audio is None:
            raise UnknownModalityError("audio", ())
        hash_waveform = getattr(self.hasher, "hash_waveform", None)
        with self.counted():
            if isinstance(raw, (bytes, bytearray, memoryview)) and hash_waveform is None:
                digest = await anyio.to_thread.run_sync(
                    self.hasher.hash_audio, cast(bytes, raw), limiter=self.limiter
                )
                return raw, digest

            def load_and_hash() -> tuple[Waveform, str]:
                waveform = audio.load(raw)
                if hash_waveform is not None:
                    return Waveform(waveform), hash_waveform(waveform)
                return Waveform(waveform), hash_pixels(waveform)

            return await anyio.to_thread.run_sync(load_and_hash, limiter=self.limiter)
