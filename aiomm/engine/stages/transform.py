"""The transform stage: one item's encoded bytes (or RGB array, or video frames) -> its item.

Input: what the hash stage returned and the request's processor kwargs. Output: a
:class:`~aiomm.processing.fields.MultiModalKwargsItem` (uint8 rows when the device normalises).
The header is probed first and the decode's peak memory (by the image's mode: a 1-bit PNG costs
about 12 bytes a pixel, not 3) admitted against the byte budget, so a few huge images cannot
exhaust memory before anything pushes back; decode, resize and patchify then run in the stage's
own worker threads (``transform_threads``, fed from one queue: a worker that finishes an item
starts the next without a trip through the loop). An encoded image whose bytes fit the budget at
once is probed, admitted and transformed in one worker trip; otherwise it waits for its bytes on
the loop and takes a second trip.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from aiomm.config import DecodeConfig, Fidelity
from aiomm.engine._audio import AudioLoader, Waveform
from aiomm.engine._byte_budget import ByteBudget
from aiomm.engine._worker_pool import WorkerPool
from aiomm.media.header import decided_size
from aiomm.media.image import EncodedImage, ImageInfo, decode_image, open_encoded, probe_image
from aiomm.media.video import (
    SampledVideo,
    VideoClip,
    VideoInfo,
    check_budget,
    decode_video,
    probe_video,
    sampled_bytes,
)
from aiomm.processing.fields import MultiModalKwargsItem
from aiomm.processing.image_ops import ReducedImage
from aiomm.processing.processor import BaseMultiModalProcessor

from ._stage import Stage, StageStatistics

__all__ = ("Decoder", "PillowDecoder", "TransformStage", "VideoLimits")


class Decoder(Protocol):
    """What the transform stage needs of a decoder (thread-safe; called in the stage's worker
    threads, which are not anyio's: ``anyio.from_thread`` is not available there)."""

    def probe(self, data: bytes) -> ImageInfo:
        """The header's size and mode and the decode's peak bytes, without decoding pixels."""
        ...

    def decode(self, data: bytes) -> np.ndarray:
        """An ``H x W x 3`` uint8 array."""
        ...


#: a decoder may also define ``probe_video(data) -> VideoInfo``, the video header its frames are
#: sampled from (default :func:`aiomm.media.video.probe_video`, HF's ``read_video_pyav`` rule),
#: ``sample_video(info) -> indices``, which then replaces the processor's ``sample_frames``,
#: ``plan_size(data) -> (height, width) | None``, the decoded size when the header decides it
#: (without it every planned image is decoded), and ``video_header_decides(info) -> bool``,
#: whether a video's sampled frames are known from its header (without it, they are decoded)


class PillowDecoder:
    """The default decoder: Pillow, with the limits of a :class:`DecodeConfig`.

    ``max_pixels`` overrides ``config.max_pixels`` (the engine passes the limit it derived).
    """

    def __init__(self, config: DecodeConfig, *, max_pixels: int | None = None) -> None:
        self.config = config
        self.max_pixels = max_pixels or config.resolved_max_pixels()
        #: the header checks every decode and probe applies (subclasses pass them on)
        self.limits: dict[str, Any] = {
            "max_pixels": self.max_pixels,
            "formats": config.formats,
            "max_pixels_per_byte": config.max_pixels_per_byte,
        }

    #: whether :meth:`decode` decodes RGB JPEGs and PNGs into arrays of its own (their peak
    #: memory: :func:`aiomm.media.image.decode_peak_bytes`)
    maps_rgb = True

    def probe(self, data: bytes) -> ImageInfo:
        """:raises DecodeError, ImageTooLargeError: see :func:`aiomm.media.image.probe_image`."""
        return probe_image(data, mapped=self.maps_rgb, **self.limits)

    def decode(self, data: bytes, *, reduce_to: tuple[int, int] | None = None) -> np.ndarray:
        """``reduce_to``: see :func:`aiomm.media.image.decode_image` (``fidelity="fast"``).

        :raises DecodeError, ImageTooLargeError: see :func:`aiomm.media.image.decode_image`.
        """
        return decode_image(data, reduce_to=reduce_to, **self.limits)

    def plan_size(self, data: bytes) -> tuple[int, int] | None:
        """The decoded ``(height, width)`` when the header decides it, else None
        (:func:`aiomm.media.header.decided_size`).

        :raises DecodeError, ImageTooLargeError: see :func:`aiomm.media.image.probe_image`.
        """
        return decided_size(data, **self.limits)

    def open(self, data: bytes) -> EncodedImage:
        """:meth:`probe` and :meth:`decode` of ``data`` in one parse of its header.

        :raises DecodeError, ImageTooLargeError: see :func:`aiomm.media.image.open_encoded`.
        """
        return open_encoded(data, mapped=self.maps_rgb, **self.limits)


class VideoLimits(NamedTuple):
    """The video budget (``DecodeConfig``'s ``max_video_*`` and the per-frame pixel limit)."""

    max_frames: int
    max_bytes: int
    max_pixels: int


class TransformStage(Stage):
    """Decodes and transforms items in worker threads, admitting decoded bytes first."""

    name = "transform"

    def __init__(
        self,
        processor: BaseMultiModalProcessor,
        decoder: Decoder,
        *,
        threads: int,
        budget: ByteBudget,
        fidelity: Fidelity = "exact",
        video_limits: VideoLimits | None = None,
        inline_bytes: int = 1 << 20,
        audio: AudioLoader | None = None,
    ) -> None:
        super().__init__(None)  # bounded by its own pool instead of a limiter (statistics())
        #: loads audio items (None: the adapter takes no audio)
        self.audio = audio
        #: the worker threads (the engine closes them when it closes)
        self.workers = WorkerPool(threads, "aiomm-transform")
        self.processor = processor
        self.decoder = decoder
        self.budget = budget
        #: ``fast``: JPEGs are decoded at a reduced scale when the resize target allows it
        #: (the caller checked that the decoder is a :class:`PillowDecoder`)
        self.fidelity: Fidelity = fidelity
        self.video_limits = video_limits or VideoLimits(768, 1 << 30, 1 << 26)
        #: a routing plan reads the header of encoded bytes below this size on the loop (a
        #: thread hop costs more than the header)
        self.inline_bytes = inline_bytes
        self._local = threading.local()
        # A decoder that keeps PillowDecoder's probe and decode has their header parsed once an
        # image (a subclass that overrides either is called as it asks).
        kind = type(decoder)
        self._opens_once = (
            isinstance(decoder, PillowDecoder)
            and kind.probe is PillowDecoder.probe
            and kind.decode is PillowDecoder.decode
        )

    async def compute(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        """The processed item of ``raw`` (encoded bytes, or an RGB array).

        :raises DecodeError, ImageTooLargeError: the image cannot be decoded within the limits.
        :raises ProcessingError: the transform failed.
        """
        with self.counted():
            if isinstance(raw, (bytes, bytearray, memoryview)):
                return await self._compute_encoded(bytes(raw), dict(kwargs), timings)
            nbytes = int(raw.nbytes)  # already an RGB array (converted by the hash stage)

            def load() -> np.ndarray:
                return raw

            await self.budget.acquire(nbytes)
            try:
                t = time.perf_counter()
                item = await self.workers.run(self._transform, load, dict(kwargs))
                timings["decode_transform"] = time.perf_counter() - t
            finally:
                self.budget.release(nbytes)
            return item

    async def _compute_encoded(
        self, data: bytes, kwargs: dict[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        # One worker trip while the budget has room: the worker probes the header, admits the
        # decode's peak bytes itself and transforms (a trip costs a small image as much CPU as
        # its resize). When the bytes do not fit, the worker hands back the header and the
        # item waits for them on the loop, holding no worker, then takes a second trip.
        taken = [0]  # the bytes this item holds, whichever thread admitted them
        try:
            t = time.perf_counter()
            first = await self.workers.run(self._probe_and_transform, data, kwargs, taken)
            if isinstance(first, ImageInfo):
                nbytes = int(first.peak_bytes)
                await self.budget.acquire(nbytes)
                taken[0] = nbytes
                t = time.perf_counter()
                first = await self.workers.run(
                    self._transform, self._loader(self._decode_of(data), first, kwargs), kwargs
                )
            timings["decode_transform"] = time.perf_counter() - t
            return first
        finally:
            if taken[0]:
                self.budget.release(taken[0])

    def _probe_and_transform(
        self, data: bytes, kwargs: dict[str, Any], taken: list[int]
    ) -> MultiModalKwargsItem | ImageInfo:
        """Worker thread: the item, or the header's info when its bytes do not fit now."""
        if self._opens_once:
            assert isinstance(self.decoder, PillowDecoder)
            with self.decoder.open(data) as image:
                if not self._admit(image.info, taken):
                    return image.info
                return self._transform(self._loader(image.decode, image.info, kwargs), kwargs)
        info = self.decoder.probe(data)
        if not self._admit(info, taken):
            return info
        return self._transform(self._loader(self._decode_of(data), info, kwargs), kwargs)

    def _admit(self, info: ImageInfo, taken: list[int]) -> bool:
        nbytes = int(info.peak_bytes)
        if not self.budget.try_take(nbytes):
            return False
        taken[0] = nbytes  # released by the loop (the caller's finally), also on an error
        return True

    def _decode_of(self, data: bytes) -> Callable[..., np.ndarray]:
        return functools.partial(self.decoder.decode, data)

    def _loader(
        self, decode: Callable[..., np.ndarray], info: ImageInfo, kwargs: Mapping[str, Any]
    ) -> Callable[[], Any]:
        target = self._reduce_target(info, kwargs)
        if target is None:
            return decode
        # (the fast mode's decoder is a PillowDecoder: the engine checked)
        return lambda: ReducedImage(decode(reduce_to=target), info.height, info.width)

    def _reduce_target(self, info: ImageInfo, kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
        # The fast mode's reduced decode applies to JPEGs whose target is at most half the source.
        if self.fidelity != "fast" or info.format != "JPEG":
            return None
        target = self.processor.resize_target(info.height, info.width, kwargs)
        if target is None or 2 * target[0] > info.height or 2 * target[1] > info.width:
            return None
        return target

    async def compute_video(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        """The processed item of the video ``raw`` (encoded bytes, or a clip of frames).

        The header is probed and the frames sampled first; the sampled frames' decoded bytes
        are admitted against the byte budget before any frame is decoded.

        :raises DecodeError: corrupt or truncated video (``EmptyVideoError``: no frame,
            ``VideoTooLargeError``: beyond the video budget).
        :raises ProcessorKwargsError: sampling kwargs that do not fit the video.
        :raises ProcessingError: the transform failed.
        """
        processor: Any = self.processor
        limits = self.video_limits
        with self.counted():
            load: Callable[[], VideoClip]
            if isinstance(raw, (bytes, bytearray, memoryview)):
                data = bytes(raw)
                probe = getattr(self.decoder, "probe_video", probe_video)
                info = await self.workers.run(probe, data)
                sample = getattr(self.decoder, "sample_video", None)
                indices = sample(info) if sample else processor.sample_frames(info, kwargs)
                check_budget(info, indices, **limits._asdict())
                nbytes = sampled_bytes(info, len(indices))

                def load() -> VideoClip:
                    return decode_video(data, lambda _: indices, info=info, **limits._asdict())
            else:  # frames in memory (stacked by the hash stage): sampled as an array video
                clip: VideoClip = raw
                t, h, w = clip.frames.shape[:3]
                indices = processor.sample_frames(VideoInfo(t, None, h, w), kwargs)
                nbytes = int(clip.frames[0].nbytes) * len(indices)

                def load() -> VideoClip:
                    if list(indices) == list(range(t)):
                        return clip
                    return VideoClip(clip.frames[indices], None, t, tuple(indices))

            await self.budget.acquire(nbytes)
            try:
                t0 = time.perf_counter()
                item = await self.workers.run(self._transform, load, dict(kwargs), "video")
                timings["decode_transform"] = time.perf_counter() - t0
            finally:
                self.budget.release(nbytes)
            return item

    async def compute_audio(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        """The processed item of the audio ``raw`` (encoded bytes, or the waveform the hash
        stage loaded), decoded and transformed in one worker trip. The waveform is admitted
        against the byte budget; encoded bytes are not (their decoded size is known only from
        the decode, which ``DecodeConfig.max_audio_decode_bytes`` bounds per worker).

        :raises DecodeError: audio that cannot be decoded within the limits.
        :raises ItemRejectedError: audio the model's processor refuses (too short).
        :raises ProcessingError: the transform failed.
        """
        audio = self.audio
        assert audio is not None  # the pipeline refuses audio for an adapter without it
        with self.counted():
            nbytes = raw.nbytes if isinstance(raw, Waveform) else 0
            await self.budget.acquire(nbytes)
            try:
                t0 = time.perf_counter()
                item = await self.workers.run(
                    self._transform, functools.partial(audio.load, raw), dict(kwargs), "audio"
                )
                timings["decode_transform"] = time.perf_counter() - t0
            finally:
                self.budget.release(nbytes)
            return item

    # ------------------------------------------------------------------ routing plans

    async def plan(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> tuple[MultiModalKwargsItem | None, str]:
        """The plan of the image ``raw`` (encoded bytes, or an RGB array) and how it was made:
        ``"header"`` (the size read from the header), ``"decoded"`` (decoded to know it). None
        (with ``"processed"``): the adapter cannot plan, the caller processes the item.

        :raises DecodeError, ImageTooLargeError, ItemRejectedError, ProcessingError: what
            processing the image would raise.
        """
        t = time.perf_counter()
        with self.counted():
            kwargs = dict(kwargs)
            if isinstance(raw, (bytes, bytearray, memoryview)):
                data = bytes(raw)
                plan_size = getattr(self.decoder, "plan_size", None)
                size = None
                if plan_size is not None:
                    # a header costs less than a thread hop, unless the bytes are large
                    inline = len(data) < self.inline_bytes
                    size = plan_size(data) if inline else await self.workers.run(plan_size, data)
                if size is not None:
                    height, width = size
                    item, how = self.processor.plan_image(height, width, kwargs), "header"
                else:
                    item, how = await self._plan_by_decoding(data, kwargs), "decoded"
            else:
                height, width = raw.shape[:2]
                item, how = self.processor.plan_image(height, width, kwargs), "header"
        timings["plan"] = time.perf_counter() - t
        return item, how if item is not None else "processed"

    async def _plan_by_decoding(
        self, data: bytes, kwargs: dict[str, Any]
    ) -> MultiModalKwargsItem | None:
        # the decode is admitted against the byte budget as a processed image's is
        # (_compute_encoded): one worker trip while the budget has room, else wait on the loop
        taken = [0]
        try:
            first = await self.workers.run(self._probe_and_plan, data, kwargs, taken)
            if isinstance(first, ImageInfo):
                nbytes = int(first.peak_bytes)
                await self.budget.acquire(nbytes)
                taken[0] = nbytes
                return await self.workers.run(self._decoded_plan, data, kwargs)
            return first
        finally:
            if taken[0]:
                self.budget.release(taken[0])

    def _probe_and_plan(
        self, data: bytes, kwargs: dict[str, Any], taken: list[int]
    ) -> MultiModalKwargsItem | ImageInfo | None:
        """Worker thread: the plan from the decoded size, or the header's info when its bytes
        do not fit the budget now."""
        info = self.decoder.probe(data)
        if not self._admit(info, taken):
            return info
        return self._decoded_plan(data, kwargs)

    def _decoded_plan(self, data: bytes, kwargs: dict[str, Any]) -> MultiModalKwargsItem | None:
        height, width = self.decoder.decode(data).shape[:2]
        return self.processor.plan_image(height, width, kwargs)

    async def plan_video(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> tuple[MultiModalKwargsItem | None, str]:
        """As :meth:`plan`, for the video ``raw`` (encoded bytes, or a clip of frames): from
        the header where the decoder says it decides the sampled frames, else from the
        sampled frames decoded."""
        processor: Any = self.processor
        limits = self.video_limits
        t0 = time.perf_counter()
        with self.counted():
            if isinstance(raw, (bytes, bytearray, memoryview)):
                data = bytes(raw)
                probe = getattr(self.decoder, "probe_video", probe_video)
                info = await self.workers.run(probe, data)
                sample = getattr(self.decoder, "sample_video", None)
                indices = sample(info) if sample else processor.sample_frames(info, kwargs)
                check_budget(info, indices, **limits._asdict())
                decides = getattr(self.decoder, "video_header_decides", None)
                how = "header"
                if decides is not None and decides(info):
                    video = SampledVideo.of(info, indices)
                else:
                    nbytes = sampled_bytes(info, len(indices))
                    await self.budget.acquire(nbytes)
                    try:
                        clip = await self.workers.run(
                            functools.partial(
                                decode_video, data, lambda _: indices, info=info,
                                **limits._asdict(),
                            )
                        )  # fmt: skip
                    finally:
                        self.budget.release(nbytes)
                    video, how = SampledVideo.of_clip(clip), "decoded"
            else:
                clip = raw
                frames, height, width = clip.frames.shape[:3]
                indices = processor.sample_frames(VideoInfo(frames, None, height, width), kwargs)
                if list(indices) == list(range(frames)):
                    video = SampledVideo.of_clip(clip)
                else:
                    video = SampledVideo(len(indices), height, width, None, frames, tuple(indices))
                how = "header"
            item = processor.plan_video(video, kwargs)
        timings["plan"] = time.perf_counter() - t0
        return item, how if item is not None else "processed"

    def statistics(self) -> StageStatistics:
        s = self.workers.statistics()
        return StageStatistics(
            self.name, s.capacity, s.in_use, s.waiting, self._completed, self._failed, s.limit
        )

    def _transform(
        self, load: Callable[[], Any], kwargs: dict[str, Any], modality: str = "image"
    ) -> MultiModalKwargsItem:
        """Worker thread: decode and transform one item."""
        image = load()
        processor = self._thread_processor()
        out = processor.process_items({modality: [image]}, kwargs, validated=True)
        device = processor.resize_device
        if device is not None and device.type == "cuda":
            # Items made on the device are cached and read from other streams: complete them first.
            torch.cuda.current_stream(device).synchronize()
        return out[modality][0]

    def _thread_processor(self) -> BaseMultiModalProcessor:
        # HF fast tokenizers are not thread-safe, so the hf path gets a processor per thread; the
        # native transform only reads the processor's parameters and is shared.
        if self.processor.transform == "native":
            return self.processor
        proc = getattr(self._local, "processor", None)
        if proc is None:
            proc = self._local.processor = self.processor.clone()
        return proc
