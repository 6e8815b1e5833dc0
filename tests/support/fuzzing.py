"""Structured inputs for fuzzing decode + transform: valid images of many formats, modes and
sizes, then corrupted the way hostile uploads are (truncated, flipped bytes, forged headers)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import PIL.Image

#: (format, modes it can save)
FORMATS = {
    "PNG": ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"),
    "JPEG": ("L", "RGB", "CMYK"),
    "WEBP": ("RGB", "RGBA"),
    "GIF": ("L", "P"),
    "BMP": ("1", "L", "P", "RGB"),
    "TIFF": ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16"),
}


def encoded(fmt: str, mode: str, width: int, height: int, seed: int) -> bytes:
    """A valid ``fmt`` file of ``mode`` pixels (noise: nothing compresses it away)."""
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    image = PIL.Image.fromarray(rgba, "RGBA")
    image = image.convert("RGB").convert(mode) if mode in ("1", "L", "P", "CMYK") else image
    if mode == "I;16":
        image = PIL.Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    elif mode in ("RGB", "LA"):
        image = image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def corrupt(data: bytes, how: str, where: float, value: int) -> bytes:
    """``data`` damaged: ``truncate`` at a fraction, ``flip`` one byte, ``zero`` a run of 64
    bytes, ``append`` garbage, or ``forge`` the PNG size (IHDR) to 2**value-scaled sides."""
    at = min(int(where * len(data)), len(data) - 1)
    if how == "truncate":
        return data[: max(at, 1)]
    if how == "flip":
        return data[:at] + bytes([data[at] ^ (value | 1)]) + data[at + 1 :]
    if how == "zero":
        return data[:at] + bytes(min(64, len(data) - at)) + data[at + 64 :]
    if how == "append":
        return data + bytes([value]) * 1000
    if how == "forge" and data[12:16] == b"IHDR":
        side = 1 << (value % 17)  # 1 .. 65536
        out = bytearray(data)
        out[16:24] = struct.pack(">II", side, max(side // 3, 1))
        out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
        return bytes(out)
    return data
