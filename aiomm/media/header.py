"""What an image's header decides: the size its decode will have, without decoding a pixel.

A routing render (``Engine.plan``) needs each image's decoded size, which the header gives,
but only where decoding would give that size and would not fail. :func:`decided_size` says so
for the two formats that carry most images, and only for a file whose structure is complete:

* **JPEG**: a baseline or extended sequential JPEG (one scan) whose bytes end with its EOI
  marker, whose marker segments hold what libjpeg accepts (Huffman tables that form a prefix
  code, a scan naming the frame's components, defined quantization tables, sampling factors)
  and whose entropy-coded data holds no marker but restart markers (a byte flipped into a
  marker is what makes libjpeg give up on an otherwise whole file); a mode Pillow decodes and
  converts (L, RGB, CMYK).
* **PNG**: every chunk whole up to IEND, each chunk's CRC right (Pillow checks only some of
  them, but a wrong one is how damage to the compressed rows shows without inflating them), a
  mode every decoder converts.

Anything else (progressive JPEGs, MPO, GIF, WebP and other formats, truncated or trailing
bytes, corrupt chunks) gets None: the caller decodes the file to know. With ``upright`` the
size is after the EXIF orientation (vLLM's loading rule): the orientation is read as Pillow
reads it, from the EXIF, else the XMP, of the header; a PNG whose metadata chunks follow its
image data (where Pillow finds them only after decoding) gets None.

The bound (tests/media/test_header.py checks it on seeded damaged files): every complete image
of these formats and every truncated one is decided as its decode decides it; a file whose
compressed pixel data was damaged while its structure stayed whole (a JPEG's entropy data with
no marker added, a PNG chunk with a CRC recomputed over damaged data) may be decided although
its decode would fail.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import PIL.Image

from aiomm.media.image import check_header, open_encoded

__all__ = ("decided_size",)

_DECIDED_FORMATS = frozenset({"JPEG", "PNG"})
_JPEG_MODES = frozenset({"L", "RGB", "CMYK"})
_PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16", "I;16B"})
# SOF0 (baseline) and SOF1 (extended sequential, Huffman): one scan holds every component
_SEQUENTIAL_SOF = (b"\xff\xc0", b"\xff\xc1")
# the bytes that may not follow 0xFF inside entropy-coded data (all but stuffing, fill and
# restart markers): a marker out of place
_STRAY_AFTER_FF = np.ones(256, dtype=bool)
_STRAY_AFTER_FF[[0x00, 0xFF, *range(0xD0, 0xD8)]] = False
# PNG chunks holding metadata Pillow reads into ``info`` (EXIF, XMP, raw EXIF profiles)
_PNG_METADATA = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt"})
_ORIENTATION = 0x0112
_SWAPS_AXES = frozenset({5, 6, 7, 8})


def decided_size(
    data: bytes,
    *,
    max_pixels: int,
    formats: tuple[str, ...],
    max_pixels_per_byte: int | None = None,
    upright: bool = False,
    opened: PIL.Image.Image | None = None,
) -> tuple[int, int] | None:
    """The ``(height, width)`` the decode of ``data`` will have, when the header decides it
    (module docstring), else None. The header goes through the decode's own checks first.
    ``opened``: ``data`` already opened by ``PIL.Image.open`` (its header is not parsed again).

    :raises DecodeError, ImageTooLargeError: what the decode would raise for this header.
    """
    if opened is not None and opened.format in _DECIDED_FORMATS and opened.format in formats:
        check_header(
            opened, len(data), max_pixels=max_pixels, max_pixels_per_byte=max_pixels_per_byte
        )
        return _decided(opened, data, upright)
    with open_encoded(
        data, max_pixels=max_pixels, formats=formats, max_pixels_per_byte=max_pixels_per_byte
    ) as encoded:
        return _decided(encoded.header, data, upright)


def _decided(image: PIL.Image.Image, data: bytes, upright: bool) -> tuple[int, int] | None:
    fmt = image.format
    if fmt == "JPEG" and image.mode in _JPEG_MODES:
        if not _whole_sequential_jpeg(data):
            return None
    elif fmt == "PNG" and image.mode in _PNG_MODES:
        late_metadata = _whole_png(data)
        if late_metadata is None or (upright and late_metadata):
            return None
    else:
        return None
    height, width = image.height, image.width
    if upright and _orientation(image) in _SWAPS_AXES:
        height, width = width, height
    return height, width


def _orientation(image: PIL.Image.Image) -> int:
    """The EXIF orientation Pillow's ``getexif`` reports once the image is loaded (for the
    formats decided here, the header holds everything it reads)."""
    try:
        # the base class's: PNG's own would decode the image first to find late chunks
        return int(PIL.Image.Image.getexif(image).get(_ORIENTATION, 1))
    except Exception:  # malformed EXIF: upright, as vLLM's loader treats it
        return 1


def _whole_sequential_jpeg(data: bytes) -> bool:
    """A one-scan JPEG ending at its EOI, with no stray marker in its entropy-coded data."""
    if not data.endswith(b"\xff\xd9"):
        return False
    sof = _marker_segment_end(data)
    if sof is None:
        return False
    scan_start, is_sequential = sof
    if not is_sequential:
        return False
    if scan_start > len(data) - 2:
        return False
    # (numpy: twice as fast as a regular expression over a photo's megabyte)
    scan = np.frombuffer(data, dtype=np.uint8, offset=scan_start, count=len(data) - 2 - scan_start)
    marks = np.flatnonzero(scan[:-1] == 0xFF)
    return not _STRAY_AFTER_FF[scan[marks + 1]].any()


def _marker_segment_end(data: bytes) -> tuple[int, bool] | None:
    """Walk the marker segments from SOI to the first SOS, checking what libjpeg refuses in
    them (Huffman tables that are no prefix code, a scan naming a component or a table the frame
    lacks, bogus sampling factors): (where the entropy-coded data starts, whether the frame is
    sequential), or None when the walk does not reach a scan libjpeg would read."""
    if not data.startswith(b"\xff\xd8"):
        return None
    i, n = 2, len(data)
    sequential = False
    components: dict[int, int] = {}  # component id -> quantization table
    quant_tables: set[int] = set()
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        (length,) = struct.unpack_from(">H", data, i + 2)
        body = data[i + 4 : i + 2 + length]
        if length < 2 or len(body) != length - 2:
            return None
        if marker == 0xC4 and not _huffman_tables_valid(body):
            return None
        if marker == 0xDB:
            quant_tables |= _quant_table_ids(body) or {-1}
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            sequential = marker in (0xC0, 0xC1)
            frame = _frame_components(body)
            if frame is None:
                return None
            components = frame
        if marker == 0xDA:
            if not components or not _scan_valid(body, components):
                return None
            if not set(components.values()) <= quant_tables:
                return None
            return i + 2 + length, sequential
        i += 2 + length
    return None


def _huffman_tables_valid(body: bytes) -> bool:
    """A DHT segment as libjpeg reads it: whole tables, each a prefix code that leaves the
    all-ones code free (``jpeg_make_d_derived_tbl``), DC symbols at most 15."""
    at = 0
    while at < len(body):
        if at + 17 > len(body):
            return False
        kind, number = body[at] >> 4, body[at] & 15
        counts = body[at + 1 : at + 17]
        total = sum(counts)
        if kind > 1 or number > 3 or total > 256 or at + 17 + total > len(body):
            return False
        longest = max((bits for bits, count in enumerate(counts, start=1) if count), default=0)
        code = 0
        for bits in range(1, longest + 1):
            code += counts[bits - 1]
            if code >= 1 << bits:
                return False
            code <<= 1
        symbols = body[at + 17 : at + 17 + total]
        if kind == 0 and max(symbols, default=0) > 15:
            return False
        at += 17 + total
    return True


def _quant_table_ids(body: bytes) -> set[int]:
    """The table ids a DQT segment defines (empty when it is malformed)."""
    ids, at = set(), 0
    while at < len(body):
        precision, number = body[at] >> 4, body[at] & 15
        size = 1 + 64 * (2 if precision else 1)
        if precision > 1 or number > 3 or at + size > len(body):
            return set()
        ids.add(number)
        at += size
    return ids


def _frame_components(body: bytes) -> dict[int, int] | None:
    """A SOF segment's components (id -> quantization table), None when libjpeg refuses it."""
    if len(body) < 6:
        return None
    count = body[5]
    if count == 0 or len(body) != 6 + 3 * count:
        return None
    out = {}
    for k in range(count):
        ident, sampling, table = body[6 + 3 * k : 9 + 3 * k]
        if not (1 <= sampling >> 4 <= 4 and 1 <= sampling & 15 <= 4) or table > 3:
            return None
        out[ident] = table
    return out


def _scan_valid(body: bytes, components: dict[int, int]) -> bool:
    """An SOS header naming components of the frame and tables libjpeg has."""
    if not body:
        return False
    count = body[0]
    if not 1 <= count <= 4 or len(body) != 4 + 2 * count:
        return False
    for k in range(count):
        ident, tables = body[1 + 2 * k], body[2 + 2 * k]
        if ident not in components or tables >> 4 > 3 or tables & 15 > 3:
            return False
    return True


def _whole_png(data: bytes) -> bool | None:
    """Whether metadata chunks follow the image data of a PNG whose chunks are whole up to
    IEND with right CRCs; None when they are not."""
    i, n, seen_idat, late = 8, len(data), False, False
    while i + 12 <= n:
        (length,) = struct.unpack_from(">I", data, i)
        kind = data[i + 4 : i + 8]
        end = i + 12 + length
        if end > n:
            return None
        (crc,) = struct.unpack_from(">I", data, end - 4)
        if zlib.crc32(memoryview(data)[i + 4 : end - 4]) != crc:
            return None
        if kind == b"IEND":
            return late if seen_idat else None
        if kind == b"IDAT":
            seen_idat = True
        elif seen_idat and kind in _PNG_METADATA:
            late = True
        i = end
    return None
