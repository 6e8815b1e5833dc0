"""Decoding encoded images the way vLLM's media loader does (``ImageMediaIO.load_bytes``).

The rule, for encoded bytes handed to a render server: the EXIF orientation is applied (a phone's
rotated JPEG comes out upright); an image with transparency (RGBA, LA, PA, or a ``tRNS`` key in
P/L/RGB) is composited on white; every other mode goes through Pillow's ``convert("RGB")``, so
16-bit greyscale is *clipped* at 255 and palettes are expanded. aiomm's default decoder
(:mod:`aiomm.media.image`) keeps HF's semantics instead (no EXIF, 16-bit scaled); a PIL image
or array given to ``Engine.process`` is never decoded here.

:class:`VllmDecoder` is a :class:`~aiomm.engine.stages.transform.Decoder`: pass it to ``Engine(...,
decoder=...)``; its ``probe_video`` and ``sample_video`` read a video's header and pick its frames
as vLLM's Qwen2-VL, Qwen3-VL, GLM-4V, GLM-OCR or LLaVA-OneVision loader does
(:mod:`aiomm.vllm.video_media`).
:func:`converts_mode` tells whether decoding changes the image mode, which vLLM folds into the
item's hash (see :mod:`aiomm.vllm.mm_hash`). :class:`VllmHasher` is a
:class:`~aiomm.engine.stages.Hasher`: pass it to ``Engine(..., hasher=...)`` and the engine's
items are identified (and cached) by vLLM's mm_hashes.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections import OrderedDict

import numpy as np
import PIL.Image
import PIL.ImageOps
from blake3 import blake3

from aiomm.config import DecodeConfig
from aiomm.engine.stages import PillowDecoder
from aiomm.errors import ConfigError, DecodeError, ImageTooLargeError, VideoTooLargeError
from aiomm.media.audio import decode_audio
from aiomm.media.header import decided_size
from aiomm.media.image import DEFAULT_FORMATS, open_encoded
from aiomm.media.video import VideoInfo, decode_video, sampled_bytes
from aiomm.vllm.mm_hash import (
    audio_mm_hash,
    image_mm_hash,
    video_mm_hash,
    vision_chunk_mm_hash,
)
from aiomm.vllm.video_media import (
    hash_metadata,
    probe_video_vllm,
    sample_indices,
    sample_indices_glm4v,
    sample_indices_glm46v,
    sample_indices_qwen3,
    sample_indices_uniform,
)

__all__ = (
    "VllmDecoder",
    "VllmHasher",
    "converts_mode",
    "load_image",
    "vllm_mm_hash",
)

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA"})
#: the largest encoded image whose opened header a thread keeps for the routing plan after it
_REMEMBERED_BYTES = 1 << 20
_ORIENTATION_TAG = 0x0112
#: EXIF orientations that move pixels (1 is upright)
_TRANSPOSED = frozenset(range(2, 9))


def _orientation(image: PIL.Image.Image) -> int:
    try:
        return int(image.getexif().get(_ORIENTATION_TAG, 1))
    except Exception:  # malformed EXIF: treated as upright, as vLLM's suppressed error does
        return 1


def _has_transparency(image: PIL.Image.Image) -> bool:
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def converts_mode(image: PIL.Image.Image) -> bool:
    """Whether vLLM's loader changes ``image``'s mode (it then hashes its io config too)."""
    return image.mode != "RGB" or _has_transparency(image)


def _to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    if _has_transparency(image):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        out = PIL.Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(
    data: bytes,
    *,
    max_pixels: int,
    formats: tuple[str, ...] = DEFAULT_FORMATS,
    max_pixels_per_byte: int | None = None,
) -> tuple[np.ndarray, bool]:
    """Decode ``data`` as vLLM does: ``(H x W x 3 uint8 array, mode converted)``. An upright
    RGB JPEG or PNG comes back as :func:`aiomm.media.image.decode_image` returns it (the first three
    channels of the 4-byte pixels it was decoded into).

    The header goes through the same checks as the engine's own decode (format allow-list,
    pixel limit, pixels per encoded byte) before any pixel is decoded.

    :raises DecodeError: empty, corrupt, truncated or unsupported image data.
    :raises ImageTooLargeError: ``width * height`` above ``max_pixels`` (checked from the header).
    """
    with open_encoded(
        data, max_pixels=max_pixels, formats=formats, max_pixels_per_byte=max_pixels_per_byte
    ) as encoded:
        # an upright RGB JPEG or PNG comes back as the array it was decoded into (no copy)
        image, pixels = encoded.load()
        try:
            if _orientation(image) in _TRANSPOSED:
                with contextlib.suppress(Exception):  # vLLM ignores malformed EXIF the same way
                    image, pixels = PIL.ImageOps.exif_transpose(image), None
            # (exif_transpose copies an upright image unchanged; skipping that changes no pixel)
            converted = converts_mode(image)
            if pixels is not None and not converted:
                return pixels, False
            rgb = _to_rgb(image)
        except (ImageTooLargeError, MemoryError):
            raise
        except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError on bad data
            raise DecodeError(
                f"cannot decode the image ({len(data)} bytes): {type(exc).__name__}: {exc}"[:200]
            ) from exc
        return np.asarray(rgb), converted


class VllmDecoder(PillowDecoder):
    """A thread-safe decoder with vLLM's loading rule (see the module docstring); probing and
    every limit are the engine's own (:class:`~aiomm.engine.stages.PillowDecoder`)."""

    #: the probe keeps the estimate of Pillow-allocated pixels: an EXIF-rotated image is
    #: copied twice more after its decode (upright RGB JPEGs and PNGs take less)
    maps_rgb = False

    #: video headers kept (by content digest): the server's hash and the engine's transform
    #: probe each video, and vLLM's header rule decodes the stream's last group of pictures
    probe_cache_size = 256

    def __init__(
        self,
        config: DecodeConfig | None = None,
        *,
        max_pixels: int | None = None,
        video_loader: str = "qwen2_vl",
    ) -> None:
        """``video_loader``: the vLLM loader whose frames :meth:`sample_video` picks,
        ``"qwen2_vl"``, ``"qwen3_vl"``, ``"glm4v"``, ``"glm46v"`` or ``"opencv"`` (vLLM's
        default loader, LLaVA-OneVision's) (:func:`aiomm.vllm.video_media.video_loader`).

        :raises ConfigError: another loader.
        """
        if video_loader not in ("qwen2_vl", "qwen3_vl", "glm4v", "glm46v", "opencv"):
            raise ConfigError(f"unknown vLLM video loader {video_loader!r}")
        super().__init__(config or DecodeConfig(), max_pixels=max_pixels)
        self.video_loader = video_loader
        self._probes: OrderedDict[bytes, VideoInfo] = OrderedDict()
        self._lock = threading.Lock()
        #: per thread, the last image header the hasher opened (:meth:`remember_header`)
        self._header = threading.local()

    # no reduce_to: the engine asks for a reduced decode only of a PillowDecoder itself (the fast
    # fidelity checks ``type(decoder) is PillowDecoder``), never of a subclass
    def decode(self, data: bytes) -> np.ndarray:  # type: ignore[override]
        """:raises DecodeError, ImageTooLargeError: see :func:`load_image`."""
        return load_image(data, **self.limits)[0]

    def plan_size(self, data: bytes) -> tuple[int, int] | None:
        """The decoded ``(height, width)``, the EXIF orientation applied, when the header
        decides it, else None (:func:`aiomm.media.header.decided_size`; the header
        :class:`VllmHasher` opened for the same bytes in this thread is not parsed again).

        :raises DecodeError, ImageTooLargeError: see :func:`load_image`.
        """
        opened = getattr(self._header, "image", None)
        if opened is not None and self._header.data is not data:
            opened = None
        return decided_size(data, **self.limits, upright=True, opened=opened)

    def remember_header(self, data: bytes, image: PIL.Image.Image) -> None:
        """Keep ``image``, ``data`` opened, for this thread's next :meth:`plan_size` of the
        same bytes object (one per thread; the one before is let go)."""
        self._header.data, self._header.image = data, image

    def video_header_decides(self, info: VideoInfo) -> bool:
        """Whether the sampled frames of a video of ``info`` are known without decoding them:
        its count was read to the stream's end, not estimated."""
        return (
            bool(getattr(info, "end_seen", False))
            and getattr(info, "readable_frames", None) is None
        )

    def probe_video(self, data: bytes) -> VideoInfo:
        """A video's header as vLLM's OpenCV capture reports it (the frames it samples from).

        :raises DecodeError, EmptyVideoError: see
            :func:`aiomm.vllm.video_media.probe_video_vllm`.
        """
        key = blake3(data, max_threads=1).digest()
        with self._lock:
            info = self._probes.get(key)
            if info is not None:
                self._probes.move_to_end(key)
                return info
        info = probe_video_vllm(data)
        with self._lock:
            self._probes[key] = info
            while len(self._probes) > self.probe_cache_size:
                self._probes.popitem(last=False)
        return info

    def sample_video(self, info: VideoInfo) -> list[int]:
        """The frames vLLM's loader (:attr:`video_loader`) reads from a video of ``info`` (it
        samples every video at 2 fps, whatever the HF processor's ``do_sample_frames``).

        :raises DecodeError, EmptyVideoError: see
            :func:`aiomm.vllm.video_media.sample_indices`, ``sample_indices_qwen3``,
            ``sample_indices_glm4v`` and ``sample_indices_glm46v``.
        """
        if self.video_loader == "qwen3_vl":
            return sample_indices_qwen3(info)
        if self.video_loader == "glm4v":
            return sample_indices_glm4v(info)
        if self.video_loader == "glm46v":
            return sample_indices_glm46v(info)
        if self.video_loader == "opencv":
            return sample_indices_uniform(info)
        return sample_indices(info)


def vllm_mm_hash(data: bytes, model_id: str) -> str:
    """vLLM's mm_hash of an image given as encoded ``data`` to a server of ``model_id``.

    :raises DecodeError: ``data`` is not a recognised image.
    """
    with _opened(data) as image:
        return image_mm_hash(data, model_id, mode_converted=converts_mode(image))


def _opened(data: bytes) -> PIL.Image.Image:
    """``data`` opened by Pillow (its header parsed, no pixel decoded).

    :raises DecodeError: ``data`` is not a recognised image.
    """
    try:
        image = PIL.Image.open(io.BytesIO(data))
        converts_mode(image)  # reads the header's mode and transparency
    except Exception as exc:
        raise DecodeError(
            f"not a recognised image ({len(data)} bytes): {type(exc).__name__}"
        ) from exc
    return image


class VllmHasher:
    """vLLM's mm_hashes of the items a render server of ``model_id`` is sent (a
    :class:`~aiomm.engine.stages.Hasher`): an image's over its bytes and whether decoding changes
    its mode; a video's over its bytes and its loader's metadata, or over its sampled frames when
    they are smaller than the file, as vLLM's hasher does. ``decoder`` probes and samples videos
    as vLLM's loader (its header cache serves the transform's probe too); videos above
    ``max_video_bytes`` encoded bytes are refused before they are probed. An audio's is over
    its decoded waveform (:meth:`hash_waveform`: the engine decodes and resamples audio to the
    adapter's rate before it asks)."""

    def __init__(
        self,
        model_id: str,
        decoder: VllmDecoder,
        *,
        max_video_bytes: int,
        audio_sampling_rate: int = 16000,
        vision_chunk: bool = False,
    ) -> None:
        self.model_id = model_id
        #: images are vLLM's ``vision_chunk`` items, hashed by their decoded pixels
        #: (:func:`~aiomm.vllm.mm_hash.vision_chunk_mm_hash`: Kimi-K2.5)
        self.vision_chunk = vision_chunk
        self.decoder = decoder
        self.max_video_bytes = max_video_bytes
        #: the rate :meth:`hash_audio` resamples encoded audio to (the adapter's)
        self.audio_sampling_rate = audio_sampling_rate

    def hash_image(self, data: bytes) -> str:
        """:raises DecodeError: ``data`` is not a recognised image."""
        if self.vision_chunk:
            return vision_chunk_mm_hash(self.decoder.decode(data), self.model_id)
        image = _opened(data)
        if len(data) <= _REMEMBERED_BYTES:
            # a routing plan reads the same header next (VllmDecoder.plan_size); larger bytes
            # are not kept alive by a thread's memory of them
            self.decoder.remember_header(data, image)
        return image_mm_hash(data, self.model_id, mode_converted=converts_mode(image))

    def hash_video(self, data: bytes) -> str:
        """:raises VideoTooLargeError: above ``max_video_bytes``.
        :raises DecodeError, EmptyVideoError: a header vLLM's loader cannot read."""
        if len(data) > self.max_video_bytes:
            raise VideoTooLargeError(
                f"a video of {len(data)} bytes is above the limit of {self.max_video_bytes} bytes"
            )
        info = self.decoder.probe_video(data)
        indices = self.decoder.sample_video(info)
        frames = None
        if sampled_bytes(info, len(indices)) < len(data):
            frames = decode_video(data, lambda _: indices, info=info).frames
        metadata = hash_metadata(info, indices, self.decoder.video_loader)
        return video_mm_hash(data, self.model_id, metadata, frames)

    def hash_waveform(self, samples: np.ndarray) -> str:
        """vLLM's mm_hash of an audio whose resampled mono waveform is ``samples``."""
        return audio_mm_hash(samples, self.model_id)

    def hash_audio(self, data: bytes) -> str:
        """vLLM's mm_hash of encoded audio, decoded at :attr:`audio_sampling_rate` with vLLM's
        default limits (the engine calls :meth:`hash_waveform` on the waveform it decoded).

        :raises DecodeError: see :func:`aiomm.media.audio.decode_audio`.
        """
        return audio_mm_hash(
            decode_audio(data, target_rate=self.audio_sampling_rate), self.model_id
        )
