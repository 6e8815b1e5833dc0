"""The decode stage: encoded image bytes (or an in-memory image) -> an ``H x W x 3`` uint8 array.

Synchronous; runs in a worker thread. The pixel count is checked against ``max_pixels`` from the
header, before any pixel is decoded, so a decompression bomb costs a header parse. The result
matches HF's ``convert_to_rgb`` (transparency composited on white, greyscale and palette
expanded), except for 16-bit greyscale, which is scaled to 8 bits instead of clipped. EXIF
orientation is not applied, as HF image processors do not apply it. Of a multi-frame image (GIF,
APNG, TIFF) only the first frame is used.
"""

from __future__ import annotations

import io
import threading
import warnings
from typing import Any

import numpy as np
import PIL.Image

from aiomm.config import DEFAULT_MAX_PIXELS as DEFAULT_MAX_PIXELS
from aiomm.config import DecodeConfig as DecodeConfig
from aiomm.errors import DecodeError, ImageTooLargeError, InvalidSourceError, ProcessingError
from aiomm.processing.image_ops import to_rgb_array

__all__ = (
    "DecodeConfig",
    "decode_image",
    "image_from_object",
    "keep_pillow_blocks",
    "probe_image_size",
)

# Pillow's modes for 16-bit (and 32-bit integer) greyscale.
_WIDE_GREY_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_MESSAGE_CHARS = 80

# warnings.catch_warnings() swaps the process-wide filter list, so two threads inside it at once
# can restore each other's filters; the lock serialises only Image.open, a header parse.
_OPEN_LOCK = threading.Lock()


def keep_pillow_blocks(blocks: int) -> int:
    """Let Pillow keep up to ``blocks`` freed image-memory blocks for reuse (process-wide).

    Raises Pillow's limit to ``blocks`` and never lowers it (another engine, or the
    ``PILLOW_BLOCKS_MAX`` environment variable, may have asked for more). Returns the limit now
    in force.
    """
    core = PIL.Image.core
    current = int(core.get_blocks_max())
    if blocks > current:
        core.set_blocks_max(blocks)
        current = blocks
    return current


def probe_image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """Return ``(width, height)`` from the image header, without decoding pixels.

    :raises DecodeError: empty bytes, or not a recognised image.
    :raises ImageTooLargeError: ``width * height`` above ``max_pixels``.
    """
    with _open(data, max_pixels) as image:
        return image.size


def decode_image(data: bytes, *, max_pixels: int) -> np.ndarray:
    """Decode encoded image bytes into a C-contiguous ``H x W x 3`` uint8 array.

    The array is usually a read-only view of the pixel bytes Pillow hands out: copying them only
    to make them writable would cost a tenth of a JPEG decode, and the pipeline only reads them.

    :raises DecodeError: empty, corrupt, truncated or unsupported image data.
    :raises ImageTooLargeError: ``width * height`` above ``max_pixels`` (checked before decoding).
    """
    with _open(data, max_pixels) as image:
        _load(image)
        return _rgb(image)


def image_from_object(obj: Any, *, max_pixels: int | None = None) -> np.ndarray:
    """Convert an in-memory image into a C-contiguous, writable ``H x W x 3`` uint8 array.

    ``obj`` is a ``PIL.Image.Image`` (loaded here if it is lazy) or a uint8 numpy array of shape
    ``H x W``, ``H x W x 1``, ``H x W x 3`` or ``H x W x 4`` (alpha composited on white). An
    array that already is RGB, contiguous and writable is returned as it is, without a copy.

    :raises InvalidSourceError: ``obj`` is neither a PIL image nor a numpy array.
    :raises DecodeError: an array of another dtype or shape, or an image Pillow cannot load.
    :raises ImageTooLargeError: more than ``max_pixels`` pixels (when given).
    """
    if isinstance(obj, PIL.Image.Image):
        if max_pixels is not None:
            _check_pixels(obj.width, obj.height, max_pixels, obj.format)
        _load(obj)
        return _rgb(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype != np.uint8:
            raise DecodeError(f"image arrays must be uint8, got dtype {obj.dtype}")
        channels = obj.shape[2] if obj.ndim == 3 else 1
        if obj.ndim not in (2, 3) or channels not in (1, 3, 4):
            raise DecodeError(
                f"image arrays must be H x W or H x W x C with C in (1, 3, 4), got shape "
                f"{obj.shape}"
            )
        if obj.shape[0] == 0 or obj.shape[1] == 0:
            raise DecodeError(f"image array has no pixels (shape {obj.shape})")
        if max_pixels is not None:
            _check_pixels(obj.shape[1], obj.shape[0], max_pixels, None)
        return _owned(to_rgb_array(obj))
    raise InvalidSourceError(
        f"unsupported image object {type(obj).__name__}; expected a PIL image or a numpy array"
    )


def _open(data: bytes, max_pixels: int) -> PIL.Image.Image:
    if not data:
        raise DecodeError("empty image data (0 bytes)")
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            # Our own check below is the limit; Pillow's warning (above its MAX_IMAGE_PIXELS)
            # would only be noise or, under ``-W error``, an exception of the wrong class.
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(data))
    except PIL.Image.DecompressionBombError as exc:
        raise ImageTooLargeError(
            f"Pillow refuses a decompression bomb ({len(data)} bytes): {_cut(exc)} "
            f"(limit here: {max_pixels} pixels)"
        ) from exc
    except PIL.UnidentifiedImageError as exc:
        raise DecodeError(f"not a recognised image format ({len(data)} bytes)") from exc
    except MemoryError:
        raise
    except Exception as exc:  # Pillow's plugins raise a wide range of classes on bad headers
        raise DecodeError(
            f"cannot read the image header of {len(data)} bytes: {_describe(exc)}"
        ) from exc
    try:
        _check_pixels(image.width, image.height, max_pixels, image.format)
    except BaseException:
        image.close()
        raise
    return image


def _check_pixels(width: int, height: int, max_pixels: int, fmt: str | None) -> None:
    what = f"{fmt} image" if fmt else "image"
    if width < 1 or height < 1:
        raise DecodeError(f"{what} has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"{what} is {width}x{height} = {width * height} pixels, above the limit of "
            f"{max_pixels} pixels"
        )


def _load(image: PIL.Image.Image) -> None:
    # Forces Pillow's lazy decode here, in the worker thread. ImageFile.LOAD_TRUNCATED_IMAGES is
    # never set, so a truncated file raises instead of decoding as grey.
    try:
        image.load()
    except MemoryError:
        raise
    except Exception as exc:
        raise DecodeError(
            f"cannot decode {_format(image)} ({image.width}x{image.height}, mode {image.mode}): "
            f"{_describe(exc)}"
        ) from exc


def _rgb(image: PIL.Image.Image) -> np.ndarray:
    try:
        if image.mode in _WIDE_GREY_MODES:
            return np.ascontiguousarray(_wide_grey_to_rgb(image))
        return np.ascontiguousarray(to_rgb_array(image))
    except (ValueError, OSError, ProcessingError) as exc:
        raise DecodeError(
            f"cannot convert {_format(image)} of mode {image.mode} to RGB: {_describe(exc)}"
        ) from exc


def _wide_grey_to_rgb(image: PIL.Image.Image) -> np.ndarray:
    # Pillow's convert("RGB") clips 16-bit samples at 255, which turns most of a 16-bit image
    # white; keeping the high byte (>> 8) maps the full 0..65535 range onto 0..255 instead.
    # Mode "I" (how Pillow opens some 16-bit files) is treated as 16-bit, negatives as 0.
    raw = np.asarray(image)
    grey = (np.clip(raw, 0, 0xFFFF).astype(np.uint16) >> 8).astype(np.uint8)
    key = image.info.get("transparency")
    if isinstance(key, int):  # a tRNS grey key: that sample value is fully transparent
        alpha = np.where(raw == key, 0, 255).astype(np.uint8)
        return to_rgb_array(np.dstack([grey, grey, grey, alpha]))
    return to_rgb_array(grey)


def _owned(array: np.ndarray) -> np.ndarray:
    # A caller's array: hand out a contiguous, writable one (a copy only when needed).
    return np.require(array, dtype=np.uint8, requirements=("C", "W"))


def _format(image: PIL.Image.Image) -> str:
    return f"{image.format} image" if image.format else "image"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if len(text) > _MESSAGE_CHARS:
        text = text[:_MESSAGE_CHARS] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _cut(exc: BaseException) -> str:
    text = str(exc)
    return text[:_MESSAGE_CHARS] + ("..." if len(text) > _MESSAGE_CHARS else "")
