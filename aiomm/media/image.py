"""The decode stage: encoded image bytes (or an in-memory image) -> an ``H x W x 3`` uint8 array.

Synchronous; runs in a worker thread. Only the formats of ``DecodeConfig.formats`` are opened.
The pixel count is checked against ``max_pixels`` (and against the encoded size,
``max_pixels_per_byte``) from the header, before any pixel is decoded, so a decompression bomb
costs a header parse; :func:`probe_image` also reports the peak memory the decode will take
(mode and conversions included), which the transform stage admits against its byte budget.
A truncated file is refused whatever ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` says. The result
matches HF's ``convert_to_rgb`` (transparency composited on white, greyscale and palette
expanded), except for 16-bit greyscale, which is scaled to 8 bits instead of clipped. An RGB
JPEG is decoded by libjpeg-turbo's TurboJPEG API (``simplejpeg``) straight into the pixel array,
the same library and settings as Pillow's decoder and the same pixels; on any complaint from it
Pillow decodes the file, so what is accepted or refused stays Pillow's. EXIF
orientation is not applied, as HF image processors do not apply it. Of a multi-frame image (GIF,
APNG, TIFF) only the first frame is used.
"""

from __future__ import annotations

import functools
import io
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import PIL.Image
import simplejpeg

from aiomm.config import DEFAULT_FORMATS as DEFAULT_FORMATS
from aiomm.config import DEFAULT_MAX_PIXELS as DEFAULT_MAX_PIXELS
from aiomm.config import DecodeConfig as DecodeConfig
from aiomm.errors import DecodeError, ImageTooLargeError, InvalidSourceError, ProcessingError
from aiomm.processing.image_ops import to_rgb_array

if TYPE_CHECKING:
    import PIL.ImageFile

__all__ = (
    "DecodeConfig",
    "EncodedImage",
    "ImageInfo",
    "check_header",
    "decode_image",
    "decode_peak_bytes",
    "image_from_object",
    "open_encoded",
    "probe_image",
    "probe_image_size",
)

# Pillow's modes for 16-bit (and 32-bit integer) greyscale.
_WIDE_GREY_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_MESSAGE_CHARS = 80
# The pixels-per-byte limit applies above this size; smaller images cost little whatever they are.
_DENSITY_FLOOR_PIXELS = 4 * 2**20

# Peak bytes per pixel of decode_image by the decoded mode, measured (tests/media/test_decode.py
# test_peak_bytes_cover_the_measured_peak): Pillow stores every 3- and 4-band mode in 4 bytes a
# pixel, converting to RGB makes another image, and handing it to numpy copies it (tobytes).
# Alpha adds the compositing images; WebP decodes into a buffer of its own first.
_PEAK_BYTES_PER_PIXEL = {"1": 12, "L": 12, "P": 12, "RGB": 11, "I;16": 11, "CMYK": 15, "YCbCr": 15}
# decoded into an array of our own (_map_rgb): the 4-byte pixels and the decoder's row buffers
_PEAK_MAPPED_RGB = 5
_PEAK_WITH_ALPHA = 24
_PEAK_OTHER = 24
_PEAK_WEBP_EXTRA = 9

# the largest read a JPEG or PNG decoder is fed at once (_load)
_READ_MAX = 1 << 20
# formats whose RGB images decode_image loads into its own 4-byte-pixel array (_map_rgb)
_MAPPED_FORMATS = frozenset({"JPEG", "PNG"})

# warnings.catch_warnings() swaps the process-wide filter list, so two threads inside it at once
# can restore each other's filters; the lock serialises only Image.open, a header parse.
_OPEN_LOCK = threading.Lock()


@dataclass(frozen=True)
class ImageInfo:
    """What an image header says, and what decoding it will cost."""

    width: int
    height: int
    mode: str
    format: str
    #: peak bytes :func:`decode_image` allocates for it (the RGB result included)
    peak_bytes: int


def decode_peak_bytes(
    mode: str,
    width: int,
    height: int,
    *,
    fmt: str = "",
    alpha: bool = False,
    mapped: bool = True,
) -> int:
    """Peak bytes :func:`decode_image` takes for an image of that decoded mode and size
    (``mapped=False``: for a decoder that lets Pillow allocate the pixels of every image)."""
    if alpha or "A" in mode or mode.endswith("a"):
        per_pixel = _PEAK_WITH_ALPHA
    elif mapped and mode == "RGB" and fmt in _MAPPED_FORMATS:
        per_pixel = _PEAK_MAPPED_RGB
    elif mode.startswith("I;16"):
        per_pixel = _PEAK_BYTES_PER_PIXEL["I;16"]
    else:
        per_pixel = _PEAK_BYTES_PER_PIXEL.get(mode, _PEAK_OTHER)
    if fmt == "WEBP":
        per_pixel += _PEAK_WEBP_EXTRA
    return width * height * per_pixel


def probe_image(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    formats: tuple[str, ...] = DEFAULT_FORMATS,
    max_pixels_per_byte: int | None = None,
    mapped: bool = True,
) -> ImageInfo:
    """Read the header of ``data``, without decoding pixels (``mapped``: see
    :func:`decode_peak_bytes`).

    :raises DecodeError: empty bytes, or not an image of one of ``formats``.
    :raises ImageTooLargeError: ``width * height`` above ``max_pixels``, or more than
        ``max_pixels_per_byte`` pixels per encoded byte (above 4 Mi pixels).
    """
    with open_encoded(
        data, max_pixels=max_pixels, formats=formats, max_pixels_per_byte=max_pixels_per_byte,
        mapped=mapped,
    ) as image:  # fmt: skip
        return image.info


class EncodedImage:
    """Encoded bytes whose header was read and checked (:func:`open_encoded`): what decoding
    them will cost (:attr:`info`), then their pixels (:meth:`decode`, once). Close it (or use it
    as a context manager) when done."""

    def __init__(self, image: PIL.Image.Image, *, mapped: bool, data: bytes | None = None) -> None:
        self._image = image
        self._mapped = mapped
        # an RGB JPEG's bytes, for the TurboJPEG decode into our own pixels (_decode_jpeg_into)
        self._jpeg = data if mapped and image.format == "JPEG" and image.mode == "RGB" else None
        alpha = image.info.get("transparency") is not None
        fmt = image.format or ""
        #: the header's size and mode, and the peak bytes :meth:`decode` takes
        self.info = ImageInfo(
            image.width,
            image.height,
            image.mode,
            fmt,
            decode_peak_bytes(
                image.mode, image.width, image.height, fmt=fmt, alpha=alpha, mapped=mapped
            ),
        )

    @property
    def header(self) -> PIL.Image.Image:
        """The opened image, its pixels not decoded (read its header, never load it)."""
        return self._image

    def decode(self, *, reduce_to: tuple[int, int] | None = None) -> np.ndarray:
        """The pixels, as :func:`decode_image` returns them (``reduce_to``: see there).

        :raises DecodeError: corrupt or truncated image data.
        """
        if reduce_to is not None:
            _draft(self._image, reduce_to)
            self._jpeg = None  # a draft decodes at Pillow's DCT scale
        image, pixels = self.load()
        return _rgb(image) if pixels is None else pixels

    def load(self) -> tuple[PIL.Image.Image, np.ndarray | None]:
        """Decode the pixels into the Pillow image, for a caller with its own conversion rule;
        with them, for an RGB JPEG or PNG opened ``mapped``, the ``H x W x 3`` view of the array
        they were decoded into (as :func:`decode_image` returns it), else None. The image stays
        valid while this object is open; the array, as long as it is referenced.

        :raises DecodeError: corrupt or truncated image data.
        """
        image = self._image
        pixels = _map_rgb(image) if self._mapped else None
        if pixels is None or self._jpeg is None or not _decode_jpeg_into(self._jpeg, pixels):
            _load(image)
        return image, None if pixels is None else pixels[:, :, :3]

    def close(self) -> None:
        """Let go of the encoded bytes (the decoded pixels stay valid)."""
        self._jpeg = None
        self._image.close()

    def __enter__(self) -> EncodedImage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_encoded(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    formats: tuple[str, ...] = DEFAULT_FORMATS,
    max_pixels_per_byte: int | None = None,
    mapped: bool = True,
) -> EncodedImage:
    """Open ``data`` and check its header, without decoding pixels: probe and decode in one
    parse of the header. ``mapped=False``: RGB JPEGs and PNGs are decoded by Pillow into its own
    memory, as other images are (and :attr:`EncodedImage.info` counts that).

    :raises DecodeError, ImageTooLargeError: as :func:`probe_image`.
    """
    image = _open(data, max_pixels, formats, max_pixels_per_byte)
    return EncodedImage(image, mapped=mapped, data=data)


def probe_image_size(
    data: bytes, max_pixels: int, formats: tuple[str, ...] = DEFAULT_FORMATS
) -> tuple[int, int]:
    """Return ``(width, height)`` from the image header, without decoding pixels.

    :raises DecodeError: empty bytes, or not an image of one of ``formats``.
    :raises ImageTooLargeError: ``width * height`` above ``max_pixels``.
    """
    with _open(data, max_pixels, formats, None) as image:
        return image.size


def decode_image(
    data: bytes,
    *,
    max_pixels: int,
    formats: tuple[str, ...] = DEFAULT_FORMATS,
    max_pixels_per_byte: int | None = None,
    reduce_to: tuple[int, int] | None = None,
) -> np.ndarray:
    """Decode encoded image bytes into an ``H x W x 3`` uint8 array.

    An RGB JPEG or PNG is decoded into an ``H x W x 4`` array of its own (Pillow's pixel layout,
    the fourth byte padding) and returned as the view of its first three channels: rows are
    contiguous, pixels 4 bytes apart (:func:`aiomm.processing.image_ops.resize` resizes the four
    channels, faster than three). Other images come back C-contiguous, usually a read-only view
    of the bytes Pillow hands out: copying them only to make them writable would cost a tenth of
    a JPEG decode, and the pipeline only reads them.
    ``reduce_to``: a ``(height, width)`` the caller resizes to next; a JPEG at least twice that
    size in both dimensions is decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (Pillow's
    ``draft``), never below it. Other formats, and smaller JPEGs, decode at full size.

    :raises DecodeError: empty, corrupt, truncated or unsupported image data, or a format not in
        ``formats``.
    :raises ImageTooLargeError: ``width * height`` above ``max_pixels``, or more than
        ``max_pixels_per_byte`` pixels per encoded byte (checked before decoding).
    """
    with open_encoded(
        data, max_pixels=max_pixels, formats=formats, max_pixels_per_byte=max_pixels_per_byte
    ) as image:
        return image.decode(reduce_to=reduce_to)


def _map_rgb(image: PIL.Image.Image) -> np.ndarray | None:
    # Pillow keeps an RGB pixel in 4 bytes; letting the decoder write straight into an array of
    # our own (as Pillow's own mmap load does) spares the GIL-held repacking copy of tobytes().
    # Only plain RGB JPEGs and PNGs, whose decoders fill every pixel of the image they are given.
    if image.mode != "RGB" or image.format not in _MAPPED_FORMATS:
        return None
    if image.info.get("transparency") is not None:  # composited on white by _rgb
        return None
    pixels = np.empty((image.height, image.width, 4), dtype=np.uint8)
    image.im = PIL.Image.core.map_buffer(pixels, image.size, "raw", 0, ("RGB", 0, 1))
    return pixels


def _decode_jpeg_into(data: bytes, pixels: np.ndarray) -> bool:
    """Decode an RGB JPEG into ``pixels`` (its ``H x W x 4`` array, Pillow's pixel layout) with
    libjpeg-turbo's TurboJPEG API, as Pillow's decoder would fill it: whether it did.

    The same library and settings as Pillow's (accurate integer DCT, smooth upsampling), so the
    same pixels (checked against Pillow over sampling factors, progressive and restart-marker
    files in the tests), written once: Pillow's decoder copies every row from libjpeg's buffer
    into the image, and its decode takes 4-9% longer. Strict: any warning libjpeg raises
    (corrupt or truncated data) is a refusal here, and Pillow then decodes the file, so what is
    accepted or refused, and how, stays Pillow's.
    """
    try:
        out = simplejpeg.decode_jpeg(
            data,
            colorspace="RGBX",
            fastdct=False,
            fastupsample=False,
            strict=True,
            buffer=pixels,
        )
    except Exception:  # every refusal leaves the decision to Pillow
        return False
    # the header Pillow read gave the array's size; a frame of another size is Pillow's to judge
    return out.shape == pixels.shape and out.ctypes.data == pixels.ctypes.data


def _draft(image: PIL.Image.Image, reduce_to: tuple[int, int]) -> None:
    height, width = reduce_to
    if image.format != "JPEG" or image.width < 2 * width or image.height < 2 * height:
        return
    # draft keeps the mode and picks the largest DCT scale whose result is still at least
    # ``(width, height)``: the exact resize that follows only ever scales down.
    image.draft(image.mode, (width, height))


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


@functools.cache
def _installed(formats: tuple[str, ...]) -> list[str]:
    # Pillow raises KeyError for a name without a plugin (HEIF needs pillow-heif): skip those.
    PIL.Image.init()
    return [f for f in formats if f in PIL.Image.OPEN]


class _Source(io.BytesIO):
    """The encoded bytes; once :meth:`track` is called, remembers whether a read came back empty
    (the decoder wanted more)."""

    ran_dry = False

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        #: the encoded bytes' length
        self.size = len(data)

    def track(self) -> None:
        """Watch the reads from here on. The header parse before it reads with BytesIO's own C
        ``read`` (a JPEG header takes dozens of small reads; a truncated header fails to parse)."""
        # through a weak reference: a closure over ``self``, stored on ``self``, is a reference
        # cycle, and the encoded bytes would wait for the garbage collector to be freed
        ref = weakref.ref(self)
        base = io.BytesIO.read

        def read(size: int | None = -1) -> bytes:
            source = ref()
            assert source is not None  # this function lives on the source itself
            chunk = base(source, size)
            if not chunk and size != 0:
                source.ran_dry = True
            return chunk

        # an instance attribute shadows the method: Pillow's load looks ``fp.read`` up each time
        self.read = read  # type: ignore[method-assign]

    def stop_tracking(self) -> None:
        """Reads from here on use BytesIO's own ``read`` again (a dry one is not a truncation)."""
        self.__dict__.pop("read", None)


def _open(
    data: bytes, max_pixels: int, formats: tuple[str, ...], max_pixels_per_byte: int | None
) -> PIL.Image.Image:
    if not data:
        raise DecodeError("empty image data (0 bytes)")
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            # Our own check below is the limit; Pillow's warning (above its MAX_IMAGE_PIXELS)
            # would only be noise or, under ``-W error``, an exception of the wrong class.
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(_Source(data), formats=_installed(formats))
    except PIL.Image.DecompressionBombError as exc:
        raise ImageTooLargeError(
            f"Pillow refuses a decompression bomb ({len(data)} bytes): {_cut(exc)} "
            f"(limit here: {max_pixels} pixels)"
        ) from exc
    except PIL.UnidentifiedImageError as exc:
        raise DecodeError(
            f"not an image of an allowed format ({len(data)} bytes; allowed: {', '.join(formats)})"
        ) from exc
    except MemoryError:
        raise
    except Exception as exc:  # Pillow's plugins raise a wide range of classes on bad headers
        raise DecodeError(
            f"cannot read the image header of {len(data)} bytes: {_describe(exc)}"
        ) from exc
    try:
        _check_pixels(image.width, image.height, max_pixels, image.format)
        _check_density(image, len(data), max_pixels_per_byte)
    except BaseException:
        image.close()
        raise
    return image


def check_header(
    image: PIL.Image.Image, size: int, *, max_pixels: int, max_pixels_per_byte: int | None = None
) -> None:
    """The checks :func:`open_encoded` applies to a header, for an image opened otherwise from
    ``size`` encoded bytes.

    :raises DecodeError, ImageTooLargeError: as :func:`probe_image`.
    """
    _check_pixels(image.width, image.height, max_pixels, image.format)
    _check_density(image, size, max_pixels_per_byte)


def _check_density(image: PIL.Image.Image, size: int, max_pixels_per_byte: int | None) -> None:
    pixels = image.width * image.height
    if max_pixels_per_byte is None or pixels <= _DENSITY_FLOOR_PIXELS:
        return
    if pixels > size * max_pixels_per_byte:
        raise ImageTooLargeError(
            f"{_format(image)} claims {image.width}x{image.height} = {pixels} pixels in "
            f"{size} bytes, more than {max_pixels_per_byte} pixels per byte (a decompression "
            "bomb or a truncated file)"
        )


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
    # Forces Pillow's lazy decode here, in the worker thread.
    source = getattr(image, "fp", None)
    if isinstance(source, _Source):
        source.track()
        # What Pillow reads after the pixels (a PNG's chunks after its image data: the last
        # CRC and IEND) may be cut off, as Pillow's own load accepts: only a read that ran
        # dry while rows were still being decoded is a truncation.
        # (An image that reads from a file is an ImageFile: what PIL.Image.open returns.)
        file = cast("PIL.ImageFile.ImageFile", image)
        load_end = file.load_end

        def rows_done_then_load_end() -> None:
            source.stop_tracking()
            load_end()

        file.load_end = rows_done_then_load_end  # type: ignore[method-assign]
        if file.format in _MAPPED_FORMATS:
            # Pillow feeds the decoder 64 KiB at a time, and each call lets go of the GIL, which
            # the worker must then win back (behind the event loop and the other workers):
            # several times a photo. Larger reads copy more of the (compressed) input at once.
            file.decodermaxblock = max(file.decodermaxblock, min(source.size, _READ_MAX))
    try:
        image.load()
    except MemoryError:
        raise
    except Exception as exc:
        raise DecodeError(
            f"cannot decode {_format(image)} ({image.width}x{image.height}, mode {image.mode}): "
            f"{_describe(exc)}"
        ) from exc
    finally:
        # the wrapper holds the image: a cycle, and the encoded bytes would wait for the GC
        image.__dict__.pop("load_end", None)
    # With ImageFile.LOAD_TRUNCATED_IMAGES on (a process-wide switch any library may flip),
    # Pillow fills a truncated file's missing rows instead of raising; an image whose rows are
    # all there never reads past the end of its bytes while decoding them, so running dry then
    # is the truncation, whatever the switch.
    if isinstance(source, _Source) and source.ran_dry:
        raise DecodeError(
            f"cannot decode {_format(image)} ({image.width}x{image.height}, mode {image.mode}): "
            "the image data is truncated"
        )


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
