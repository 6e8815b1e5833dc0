"""The transform stage: one item's encoded bytes (or RGB array) -> its processed item.

Input: what the hash stage returned and the request's processor kwargs. Output: a
:class:`~aiomm.processing.fields.MultiModalKwargsItem` (uint8 rows when the device normalises).
The header is probed first and the decode's peak memory (by the image's mode: a 1-bit PNG costs
about 12 bytes a pixel, not 3) admitted against the byte budget, so a few huge images cannot
exhaust memory before anything pushes back; decode, resize and patchify then run in one worker
thread, bounded by ``transform_threads``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio.to_thread
import numpy as np
import torch

from aiomm.admission import ByteBudget
from aiomm.config import DecodeConfig, Fidelity
from aiomm.decode import ImageInfo, decode_image, probe_image
from aiomm.processing.fields import MultiModalKwargsItem
from aiomm.processing.image_ops import ReducedImage
from aiomm.processing.processor import BaseMultiModalProcessor

from ._stage import Stage

__all__ = ("Decoder", "PillowDecoder", "TransformStage")


class Decoder(Protocol):
    """What the transform stage needs of a decoder (thread-safe; called in worker threads)."""

    def probe(self, data: bytes) -> ImageInfo:
        """The header's size and mode and the decode's peak bytes, without decoding pixels."""
        ...

    def decode(self, data: bytes) -> np.ndarray:
        """An ``H x W x 3`` uint8 array."""
        ...


class PillowDecoder:
    """The default decoder: Pillow, with the limits of a :class:`DecodeConfig`.

    ``max_pixels`` overrides ``config.max_pixels`` (the engine passes the limit it derived).
    """

    def __init__(self, config: DecodeConfig, *, max_pixels: int | None = None) -> None:
        self.config = config
        self.max_pixels = max_pixels or config.resolved_max_pixels()

    def probe(self, data: bytes) -> ImageInfo:
        """:raises DecodeError, ImageTooLargeError: see :func:`aiomm.decode.probe_image`."""
        cfg = self.config
        return probe_image(
            data,
            max_pixels=self.max_pixels,
            formats=cfg.formats,
            max_pixels_per_byte=cfg.max_pixels_per_byte,
        )

    def decode(self, data: bytes, *, reduce_to: tuple[int, int] | None = None) -> np.ndarray:
        """``reduce_to``: see :func:`aiomm.decode.decode_image` (``fidelity="fast"``).

        :raises DecodeError, ImageTooLargeError: see :func:`aiomm.decode.decode_image`.
        """
        cfg = self.config
        return decode_image(
            data,
            max_pixels=self.max_pixels,
            formats=cfg.formats,
            max_pixels_per_byte=cfg.max_pixels_per_byte,
            reduce_to=reduce_to,
        )


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
    ) -> None:
        super().__init__(threads)
        self.processor = processor
        self.decoder = decoder
        self.budget = budget
        #: ``fast``: JPEGs are decoded at a reduced scale when the resize target allows it
        #: (the caller checked that the decoder is a :class:`PillowDecoder`)
        self.fidelity: Fidelity = fidelity
        self._local = threading.local()

    async def compute(
        self, raw: Any, kwargs: Mapping[str, Any], timings: dict[str, float]
    ) -> MultiModalKwargsItem:
        """The processed item of ``raw`` (encoded bytes, or an RGB array).

        :raises DecodeError, ImageTooLargeError: the image cannot be decoded within the limits.
        :raises ProcessingError: the transform failed.
        """
        with self.counted():
            load: Callable[[], Any]
            if isinstance(raw, (bytes, bytearray, memoryview)):
                data = bytes(raw)
                info = await anyio.to_thread.run_sync(
                    self.decoder.probe, data, limiter=self.limiter
                )
                nbytes = int(info.peak_bytes)
                target = self._reduce_target(info, kwargs)
                if target is None:

                    def load() -> Any:
                        return self.decoder.decode(data)
                else:
                    decoder = self.decoder
                    assert isinstance(decoder, PillowDecoder)

                    def load() -> Any:
                        pixels = decoder.decode(data, reduce_to=target)
                        return ReducedImage(pixels, info.height, info.width)
            else:  # already an RGB array (converted by the hash stage)
                nbytes = int(raw.nbytes)

                def load() -> np.ndarray:
                    return raw

            await self.budget.acquire(nbytes)
            try:
                t = time.perf_counter()
                item = await anyio.to_thread.run_sync(
                    self._transform, load, dict(kwargs), limiter=self.limiter
                )
                timings["decode_transform"] = time.perf_counter() - t
            finally:
                self.budget.release(nbytes)
            return item

    def _reduce_target(self, info: ImageInfo, kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
        # The fast mode's reduced decode applies to JPEGs whose target is at most half the source.
        if self.fidelity != "fast" or info.format != "JPEG":
            return None
        target = self.processor.resize_target(info.height, info.width, kwargs)
        if target is None or 2 * target[0] > info.height or 2 * target[1] > info.width:
            return None
        return target

    def _transform(self, load: Callable[[], Any], kwargs: dict[str, Any]) -> MultiModalKwargsItem:
        """Worker thread: decode and transform one image."""
        image = load()
        processor = self._thread_processor()
        out = processor.process_items({"image": [image]}, kwargs, validated=True)
        device = processor.resize_device
        if device is not None and device.type == "cuda":
            # Items made on the device are cached and read from other streams: complete them first.
            torch.cuda.current_stream(device).synchronize()
        return out["image"][0]

    def _thread_processor(self) -> BaseMultiModalProcessor:
        # HF fast tokenizers are not thread-safe, so the hf path gets a processor per thread; the
        # native transform only reads the processor's parameters and is shared.
        if self.processor.transform == "native":
            return self.processor
        proc = getattr(self._local, "processor", None)
        if proc is None:
            proc = self._local.processor = self.processor.clone()
        return proc
