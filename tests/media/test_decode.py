"""decode_image / probe_image_size / image_from_object on images generated here with Pillow."""

from __future__ import annotations

import gc
import io
import re
import struct
import subprocess
import sys
import time
import warnings
import zlib
from typing import Any

import anyio
import numpy as np
import PIL.Image
import PIL.ImageFile
import pytest

from aiomm.errors import DecodeError, ImageTooLargeError, InvalidSourceError
from aiomm.media.image import (
    DecodeConfig,
    decode_image,
    image_from_object,
    probe_image,
    probe_image_size,
)
from aiomm.processing.image_ops import as_tensor_view, padded_pixels

#: a deployment's limit below Pillow's warning threshold (the default is Pillow's bomb limit)
MAX = 64 * 2**20


def encode(image: PIL.Image.Image, fmt: str, **params: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **params)
    return buf.getvalue()


def decode(data: bytes, max_pixels: int = MAX) -> np.ndarray:
    out = decode_image(data, max_pixels=max_pixels)
    assert_rgb(out)
    return out


def assert_rgb(out: np.ndarray, shape: tuple[int, int] | None = None) -> None:
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3, (out.dtype, out.shape)
    # C-contiguous, or the first three channels of an array of 4-byte pixels (RGB JPEG / PNG)
    assert out.flags.c_contiguous or padded_pixels(out) is not None
    # read-only views of Pillow's bytes are fine: the pipeline wraps them without a copy
    assert as_tensor_view(out).data_ptr() == out.ctypes.data
    if shape is not None:
        assert out.shape[:2] == shape


def noise(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def png_with_size(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR claims ``width x height`` (CRC fixed): a cheap bomb header."""
    data = bytearray(encode(PIL.Image.new("L", (8, 8), 0), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# -- formats and modes ---------------------------------------------------------------------------


def test_png_rgb_is_exact() -> None:
    src = noise(17, 23)
    out = decode(encode(PIL.Image.fromarray(src), "PNG"))
    assert np.array_equal(out, src)


@pytest.mark.parametrize(
    ("mode", "fmt", "mapped"),
    [("RGB", "JPEG", True), ("RGB", "PNG", True), ("L", "JPEG", False), ("L", "PNG", False),
     ("RGBA", "PNG", False), ("P", "PNG", False), ("RGB", "WEBP", False), ("RGB", "GIF", False),
     ("RGB", "BMP", False), ("CMYK", "JPEG", False)],
)  # fmt: skip
def test_rgb_jpegs_and_pngs_decode_into_4_byte_pixels(mode: str, fmt: str, mapped: bool) -> None:
    image = PIL.Image.fromarray(noise(19, 31)).convert(mode)
    data = encode(image, fmt)
    out = decode(data)
    assert (padded_pixels(out) is not None) is mapped
    assert out.flags.c_contiguous is not mapped
    # (the RGBA image is opaque: composited on white, its pixels stay as they are)
    assert np.array_equal(out, np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")))


def test_a_photo_is_fed_to_the_decoder_in_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # every read the decoder takes lets go of the GIL and must win it back
    import aiomm.media.image

    reads: list[int] = []
    track = aiomm.media.image._Source.track

    def counting_track(self: Any) -> None:
        track(self)
        read = self.read
        self.read = lambda size=-1: reads.append(size) or read(size)

    monkeypatch.setattr(aiomm.media.image._Source, "track", counting_track)
    # Pillow's decode (TurboJPEG's, which takes the bytes in one call, would read nothing)
    monkeypatch.setattr(aiomm.media.image, "_decode_jpeg_into", lambda data, pixels: False)
    data = encode(PIL.Image.fromarray(noise(400, 600)), "JPEG", quality=95)
    assert len(data) > 4 * 65536
    assert np.array_equal(decode(data), np.asarray(PIL.Image.open(io.BytesIO(data))))
    assert reads and reads[0] >= len(data) - 1000 and len(reads) <= 2, reads


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP"])
def test_the_encoded_bytes_are_freed_without_the_garbage_collector(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a reference cycle would keep every image's bytes until the collector's next pass
    import weakref

    import aiomm.media.image

    sources: list[weakref.ref[Any]] = []
    track = aiomm.media.image._Source.track

    def recording_track(self: Any) -> None:
        sources.append(weakref.ref(self))
        track(self)

    monkeypatch.setattr(aiomm.media.image._Source, "track", recording_track)
    monkeypatch.setattr(
        aiomm.media.image, "_decode_jpeg_into", lambda data, pixels: False
    )  # Pillow's
    data = encode(PIL.Image.fromarray(noise(64, 80)), fmt)
    gc.disable()
    try:
        assert decode(data).shape == (64, 80, 3)
        assert sources, "the decode read through a tracked source"
        assert all(ref() is None for ref in sources), "a source outlived its decode"
    finally:
        gc.enable()


def _pillow_pixels(data: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize(
    "params",
    [
        {"subsampling": 0, "quality": 95},  # 4:4:4
        {"subsampling": 1, "quality": 90},  # 4:2:2
        {"subsampling": 2, "quality": 75},  # 4:2:0
        {"subsampling": 2, "quality": 90, "progressive": True},
        {"subsampling": 2, "quality": 85, "optimize": True},
        {"subsampling": 1, "quality": 80, "restart_marker_blocks": 3},
        {"subsampling": 2, "quality": 100},
        {"subsampling": 2, "quality": 5},
    ],
    ids=["444", "422", "420", "progressive", "optimized", "restarts", "q100", "q5"],
)
@pytest.mark.parametrize("size", [(37, 53), (720, 1280), (1, 1), (9, 17)])
def test_rgb_jpegs_decoded_by_turbojpeg_equal_pillows_pixels(
    params: dict[str, Any], size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An RGB JPEG is decoded by libjpeg-turbo's TurboJPEG API straight into the 4-byte pixels:
    the same values as Pillow's decode, for every sampling factor and coding option."""
    import aiomm.media.image

    taken: list[bool] = []
    turbo = aiomm.media.image._decode_jpeg_into
    monkeypatch.setattr(
        aiomm.media.image,
        "_decode_jpeg_into",
        lambda d, px: taken.append(turbo(d, px)) or taken[-1],
    )
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([(x * 7 + y * 3) % 256, (x * y) % 256, (255 - x * 2) % 256], axis=-1)
    pixels = np.clip(smooth + noise(h, w).astype(int) // 4 - 32, 0, 255).astype(np.uint8)
    data = encode(PIL.Image.fromarray(pixels), "JPEG", **params)
    out = decode(data)
    assert taken == [True], "TurboJPEG decoded it"
    assert padded_pixels(out) is not None
    assert np.array_equal(out, _pillow_pixels(data))


def test_a_jpeg_turbojpeg_complains_about_is_pillows_to_decode_or_refuse() -> None:
    """Strict TurboJPEG refuses data libjpeg only warns about; Pillow then decides, as before:
    trailing garbage after the image decodes as Pillow decodes it, a truncated file is refused."""
    import aiomm.media.image

    data = encode(PIL.Image.fromarray(noise(64, 48)), "JPEG", quality=90)
    pixels = np.empty((64, 48, 4), np.uint8)
    assert aiomm.media.image._decode_jpeg_into(data, pixels)
    assert not aiomm.media.image._decode_jpeg_into(data[: len(data) * 2 // 3], pixels)
    assert not aiomm.media.image._decode_jpeg_into(data, np.empty((64, 47, 4), np.uint8))
    # bytes inside the entropy-coded data changed: libjpeg warns, Pillow decodes what it can
    corrupt = bytearray(data)
    corrupt[len(data) // 2 : len(data) // 2 + 8] = b"\xff\x00" * 4
    corrupt = bytes(corrupt)
    try:
        expected: np.ndarray | None = _pillow_pixels(corrupt)
    except OSError:
        expected = None
    if expected is None:
        _exactly(DecodeError, decode_image, corrupt, max_pixels=MAX)
    else:
        assert np.array_equal(decode(corrupt), expected)
    _exactly(DecodeError, decode_image, data[: len(data) * 2 // 3], max_pixels=MAX)


def test_png_with_a_transparency_key_is_not_mapped() -> None:
    image = PIL.Image.fromarray(noise(8, 9))
    buf = io.BytesIO()
    image.save(buf, format="PNG", transparency=tuple(int(v) for v in noise(8, 9)[0, 0]))
    out = decode(buf.getvalue())
    assert padded_pixels(out) is None
    assert tuple(out[0, 0]) == (255, 255, 255)  # the keyed colour composited on white


def test_jpeg_matches_pillow_and_source() -> None:
    src = np.zeros((32, 48, 3), np.uint8)
    src[:, :24] = (200, 30, 40)
    src[:, 24:] = (20, 180, 90)
    data = encode(PIL.Image.fromarray(src), "JPEG", quality=95)
    out = decode(data)
    assert np.array_equal(out, np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")))
    assert np.abs(out.astype(int) - src).mean() < 4


def test_rgba_partial_alpha_is_composited_on_white() -> None:
    rgba = np.zeros((4, 5, 4), np.uint8)
    rgba[...] = (0, 100, 255, 51)  # alpha 0.2: out = 0.2 * c + 0.8 * 255
    rgba[0, 0] = (10, 20, 30, 255)  # opaque
    rgba[0, 1] = (10, 20, 30, 0)  # fully transparent
    out = decode(encode(PIL.Image.fromarray(rgba, "RGBA"), "PNG"))
    assert tuple(out[2, 2]) == (204, 224, 255)
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert tuple(out[0, 1]) == (255, 255, 255)


def test_la_and_l() -> None:
    la = np.zeros((3, 3, 2), np.uint8)
    la[...] = (100, 51)
    out = decode(encode(PIL.Image.fromarray(la, "LA"), "PNG"))
    assert tuple(out[1, 1]) == (224, 224, 224)  # 0.2 * 100 + 0.8 * 255
    grey = noise(6, 7, channels=1)
    out = decode(encode(PIL.Image.fromarray(grey, "L"), "PNG"))
    assert np.array_equal(out, np.repeat(grey[..., None], 3, axis=2))


def _palette_image(transparent_index: int | None) -> PIL.Image.Image:
    image = PIL.Image.new("P", (4, 2))
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 - 3) * 3)
    image.putdata([0, 1, 2, 0, 1, 2, 0, 1])
    if transparent_index is not None:
        image.info["transparency"] = transparent_index
    return image


def test_palette_png() -> None:
    out = decode(encode(_palette_image(None), "PNG"))
    assert [tuple(p) for p in out[0]] == [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 0, 0)]


def test_gif_palette_with_transparency() -> None:
    image = _palette_image(1)
    data = encode(image, "GIF", transparency=1)
    out = decode(data)
    # index 1 (green) is transparent -> white; the others keep their palette colour
    assert [tuple(p) for p in out[0]] == [(255, 0, 0), (255, 255, 255), (0, 0, 255), (255, 0, 0)]


def test_cmyk_jpeg() -> None:
    rgb = np.zeros((16, 16, 3), np.uint8)
    rgb[...] = (220, 40, 30)
    cmyk = PIL.Image.fromarray(rgb).convert("CMYK")
    data = encode(cmyk, "JPEG", quality=95)
    assert PIL.Image.open(io.BytesIO(data)).mode == "CMYK"
    out = decode(data)
    assert np.array_equal(out, np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")))
    assert np.abs(out.astype(int) - rgb).max() < 12


def test_16_bit_greyscale_is_scaled_not_clipped() -> None:
    values = np.array([[0, 255, 256, 32768, 40000, 65535]], dtype=np.uint16)
    data = encode(PIL.Image.fromarray(values), "PNG")
    assert PIL.Image.open(io.BytesIO(data)).mode in ("I;16", "I")
    out = decode(data)
    assert list(out[0, :, 0]) == [0, 0, 1, 128, 156, 255]
    assert np.array_equal(out[..., 0], out[..., 2])
    # what convert("RGB") would give: every value above 255 saturates
    assert (
        list(np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB"))[0, :, 0])[2:] == [255] * 4
    )


def test_one_pixel() -> None:
    out = decode(encode(PIL.Image.new("RGB", (1, 1), (7, 8, 9)), "PNG"))
    assert out.shape == (1, 1, 3) and tuple(out[0, 0]) == (7, 8, 9)


def test_multi_frame_gif_uses_the_first_frame() -> None:
    frames = [PIL.Image.new("RGB", (6, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert PIL.Image.open(io.BytesIO(data)).n_frames == 2
    out = decode(data)
    assert (out == (255, 0, 0)).all()


def test_animated_png_uses_the_first_frame() -> None:
    frames = [PIL.Image.new("RGB", (6, 4), c) for c in ((0, 255, 0), (0, 0, 255))]
    data = encode(frames[0], "PNG", save_all=True, append_images=frames[1:])
    assert PIL.Image.open(io.BytesIO(data)).n_frames == 2
    assert (decode(data) == (0, 255, 0)).all()


def test_exif_orientation_is_not_applied() -> None:
    src = noise(4, 6)
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW" - HF processors ignore it, and so do we
    out = decode(encode(PIL.Image.fromarray(src), "PNG", exif=exif))
    assert np.array_equal(out, src)


# -- bad input -----------------------------------------------------------------------------------


def _exactly(exc_type: type[Exception], fn: Any, *args: Any, **kwargs: Any) -> Exception:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc_type, repr(info.value)
    return info.value


def test_empty() -> None:
    exc = _exactly(DecodeError, decode_image, b"", max_pixels=MAX)
    assert "empty" in str(exc)
    _exactly(DecodeError, probe_image_size, b"", MAX)


@pytest.mark.parametrize(
    "data",
    [
        b"\x89PNG\r\n\x1a\n" + b"garbage" * 50,
        b"\xff\xd8\xff" + b"\x00" * 64,
        np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        b"GIF89a",
        b"not an image at all",
    ],
    ids=["png-garbage", "jpeg-garbage", "random", "gif-header-only", "text"],
)
def test_corrupt(data: bytes) -> None:
    exc = _exactly(DecodeError, decode_image, data, max_pixels=MAX)
    assert "garbage" not in str(exc)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated(fmt: str) -> None:
    data = encode(PIL.Image.fromarray(noise(64, 64)), fmt)
    exc = _exactly(DecodeError, decode_image, data[: len(data) // 2], max_pixels=MAX)
    assert fmt in str(exc)


# -- size limits ---------------------------------------------------------------------------------


def test_bomb_is_refused_before_any_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = png_with_size(30_000, 30_000)
    assert len(bomb) < 200

    def no_load(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", no_load)
    start = time.perf_counter()
    for max_pixels in (MAX, 10**12):  # ours refuses it; with ours lifted, Pillow's limit does
        with pytest.raises(ImageTooLargeError):
            decode_image(bomb, max_pixels=max_pixels)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("width", "height"),
    [
        (9_000, 9_000),  # below Pillow's warning threshold (~89.5 Mi pixels), above ours
        (10_000, 10_000),  # between Pillow's warning and error thresholds
    ],
)
def test_header_above_max_pixels(width: int, height: int) -> None:
    # pytest turns warnings into errors: a DecompressionBombWarning escaping would fail here
    data = png_with_size(width, height)
    exc = _exactly(ImageTooLargeError, decode_image, data, max_pixels=MAX)
    assert f"{width}x{height}" in str(exc) and str(MAX) in str(exc)
    _exactly(ImageTooLargeError, probe_image_size, data, MAX)


def test_limit_above_pillows_warning_threshold_is_honoured() -> None:
    assert probe_image_size(png_with_size(10_000, 10_000), 120_000_000) == (10_000, 10_000)


def test_max_pixels_boundary() -> None:
    data = encode(PIL.Image.fromarray(noise(100, 100)), "PNG")
    assert probe_image_size(data, 10_000) == (100, 100)
    assert decode(data, max_pixels=10_000).shape == (100, 100, 3)
    exc = _exactly(ImageTooLargeError, decode_image, data, max_pixels=9_999)
    assert "100x100 = 10000 pixels" in str(exc) and "9999" in str(exc)


async def test_concurrent_decodes_leave_the_warning_filters_alone() -> None:
    # catch_warnings() is process-wide; the lock keeps concurrent decodes from restoring each
    # other's filter lists.
    before = list(warnings.filters)
    good = encode(PIL.Image.fromarray(noise(300, 300)), "PNG")
    bomb = png_with_size(10_000, 10_000)
    outcomes: list[str] = []

    async def one(data: bytes) -> None:
        try:
            await anyio.to_thread.run_sync(lambda: decode_image(data, max_pixels=MAX))
            outcomes.append("ok")
        except ImageTooLargeError:
            outcomes.append("too large")

    async with anyio.create_task_group() as tg:
        for i in range(32):
            tg.start_soon(one, bomb if i % 2 else good)
    assert sorted(outcomes) == ["ok"] * 16 + ["too large"] * 16
    assert warnings.filters == before


def test_decode_config() -> None:
    assert DecodeConfig().max_pixels is None
    # Pillow's bomb limit (twice its warning threshold), vLLM's VLLM_MAX_IMAGE_PIXELS default
    assert DecodeConfig().resolved_max_pixels() == 178_956_970 == 2 * PIL.Image.MAX_IMAGE_PIXELS
    assert DecodeConfig(max_pixels=5).resolved_max_pixels() == 5
    assert DecodeConfig(formats=("png", "jpeg")).formats == ("PNG", "JPEG")
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            DecodeConfig(max_pixels=bad)  # type: ignore[arg-type]
    for formats in ("PNG", ("PNG", 3), ("",)):
        with pytest.raises(ValueError, match=r"DecodeConfig\.formats"):
            DecodeConfig(formats=formats)  # type: ignore[arg-type]


# -- decoder surface -----------------------------------------------------------------------------


def _eps() -> bytes:
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (_eps(), "EPS"),
        (b"P6\n4 4\n255\n" + bytes(48), "PPM"),
        (encode(PIL.Image.fromarray(noise(8, 8)), "ICO"), "ICO"),
        (encode(PIL.Image.fromarray(noise(8, 8)), "TGA"), "TGA"),
    ],
)
def test_formats_outside_the_allow_list_are_refused_unopened(data: bytes, fmt: str) -> None:
    # Pillow itself opens each of these
    assert PIL.Image.open(io.BytesIO(data)).format == fmt
    exc = _exactly(DecodeError, decode_image, data, max_pixels=MAX)
    assert "allowed: JPEG, PNG" in str(exc)
    _exactly(DecodeError, probe_image, data)


def test_allow_list_is_configurable() -> None:
    png = encode(PIL.Image.fromarray(noise(8, 8)), "PNG")
    with pytest.raises(DecodeError, match="allowed: JPEG"):
        decode_image(png, max_pixels=MAX, formats=("JPEG",))
    tga = encode(PIL.Image.fromarray(noise(8, 8)), "TGA")
    assert np.array_equal(decode_image(tga, max_pixels=MAX, formats=("TGA",)), noise(8, 8))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "TIFF"])
def test_truncated_is_refused_whatever_load_truncated_images_says(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # another library in the process may switch Pillow's global on
    monkeypatch.setattr(PIL.ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    image = PIL.Image.fromarray(noise(64, 48))
    data = encode(image if fmt != "GIF" else image.convert("P"), fmt)
    assert decode(data).shape == (64, 48, 3)  # complete files still decode
    exc = _exactly(DecodeError, decode_image, data[: len(data) * 2 // 3], max_pixels=MAX)
    assert "truncated" in str(exc)


@pytest.mark.parametrize("load_truncated", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_a_png_cut_after_its_last_row_decodes_as_pillow_decodes_it(
    mode: str, load_truncated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final IEND chunk (12 bytes) and the image data's CRC and checksum cut off: every row
    is there, Pillow (and vLLM) decode it; cut into the rows it is refused, whatever Pillow's
    global switch says."""
    monkeypatch.setattr(PIL.ImageFile, "LOAD_TRUNCATED_IMAGES", load_truncated)
    image = PIL.Image.fromarray(noise(60, 90)).convert(mode)
    data = encode(image, "PNG")
    whole = decode(data)
    for cut in (1, 4, 12, 13, 16, 20):
        assert np.array_equal(decode(data[:-cut]), whole), cut
    exc = _exactly(DecodeError, decode_image, data[:-40], max_pixels=MAX)
    assert "truncated" in str(exc)


def test_pixels_per_byte_limit_refuses_a_tiny_file_with_a_huge_header() -> None:
    # a PNG header of 8000 x 8000 over a few bytes of IDAT: Pillow alone decodes it zero-filled
    data = png_with_size(8000, 8000)
    assert len(data) < 200
    exc = _exactly(
        ImageTooLargeError, decode_image, data, max_pixels=10**8, max_pixels_per_byte=8192
    )
    assert "pixels per byte" in str(exc)
    _exactly(ImageTooLargeError, probe_image, data, max_pixels=10**8, max_pixels_per_byte=8192)
    # small images are never judged by density
    small = encode(PIL.Image.new("1", (2000, 2000)), "PNG")
    assert decode_image(small, max_pixels=MAX, max_pixels_per_byte=1).shape == (2000, 2000, 3)


_PEAK_CASES = [("1", "PNG"), ("L", "PNG"), ("P", "PNG"), ("RGB", "PNG"), ("RGBA", "PNG"),
               ("LA", "PNG"), ("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "WEBP"),
               ("RGBA", "WEBP"), ("I;16", "PNG"), ("RGB", "GIF"), ("RGB", "BMP"),
               ("RGB", "TIFF")]  # fmt: skip

_PEAK_SCRIPT = """
import ctypes, gc, io, sys, PIL.Image
from aiomm.media.image import decode_image, probe_image

trim = ctypes.CDLL("libc.so.6").malloc_trim

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

for case in sys.argv[1:]:
    mode, fmt = case.split(",")
    buf = io.BytesIO()
    PIL.Image.new(mode, (2048, 2048)).save(buf, format=fmt)
    data = buf.getvalue()
    info = probe_image(data)
    gc.collect()
    trim(0)  # memory freed by the cases before must not serve this one
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident size, to the current size
    start = status("VmRSS")
    out = decode_image(data, max_pixels=1 << 30)
    print(case, info.peak_bytes, status("VmHWM") - start)
    del out
"""


def test_peak_bytes_cover_the_measured_peak() -> None:
    # Pillow allocates outside tracemalloc's view, so the peak is the process's (VmHWM), in one
    # fresh interpreter (pytest's may have tuned malloc to keep freed memory).
    lines = subprocess.run(
        [sys.executable, "-P", "-c", _PEAK_SCRIPT, *(f"{m},{f}" for m, f in _PEAK_CASES)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(lines) == len(_PEAK_CASES)
    for line in lines:
        case, estimate, measured = line.split()[0], int(line.split()[1]), int(line.split()[2])
        assert measured <= estimate, (case, estimate, measured)
        # and not far above it: the budget must not starve the stage either
        assert estimate <= 2 * measured + (4 << 20), (case, estimate, measured)
        if case.startswith("1,"):  # 1-bit costs far more than the W*H*3 once counted
            assert estimate >= 3 * 2048 * 2048 * 3


# -- in-memory objects ---------------------------------------------------------------------------


def test_image_from_pil() -> None:
    rgba = PIL.Image.new("RGBA", (3, 2), (0, 100, 255, 51))
    out = image_from_object(rgba)
    assert_rgb(out, (2, 3))
    assert tuple(out[0, 0]) == (204, 224, 255)
    lazy = PIL.Image.open(io.BytesIO(encode(PIL.Image.fromarray(noise(5, 4)), "PNG")))
    assert np.array_equal(image_from_object(lazy), noise(5, 4))


def test_image_from_lazy_truncated_pil_raises_decode_error() -> None:
    data = encode(PIL.Image.fromarray(noise(64, 64)), "JPEG")
    lazy = PIL.Image.open(io.BytesIO(data[: len(data) // 2]))
    _exactly(DecodeError, image_from_object, lazy)


def test_image_from_pil_honours_max_pixels() -> None:
    _exactly(ImageTooLargeError, image_from_object, PIL.Image.new("L", (10, 10)), max_pixels=99)


def test_image_from_arrays() -> None:
    rgb = noise(4, 5)
    assert image_from_object(rgb) is rgb  # already RGB, contiguous, writable: no copy
    grey = noise(4, 5, channels=1)
    for arr in (grey, grey[..., None]):
        out = image_from_object(arr)
        assert_rgb(out, (4, 5))
        assert np.array_equal(out[..., 1], grey)
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[...] = (0, 100, 255, 51)
    assert tuple(image_from_object(rgba)[1, 1]) == (204, 224, 255)
    view = noise(4, 6)[:, ::2]  # not contiguous
    out = image_from_object(view)
    assert_rgb(out, (4, 3))
    assert np.array_equal(out, view)
    frozen = noise(3, 3)
    frozen.flags.writeable = False
    assert_rgb(image_from_object(frozen))


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((4, 4, 3), np.float32), "dtype float32"),
        (np.zeros((4, 4, 3), np.uint16), "dtype uint16"),
        (np.zeros((4, 4, 2), np.uint8), r"shape \(4, 4, 2\)"),
        (np.zeros((2, 4, 4, 3), np.uint8), r"shape \(2, 4, 4, 3\)"),
        (np.zeros((4,), np.uint8), r"shape \(4,\)"),
        (np.zeros((0, 4, 3), np.uint8), "no pixels"),
    ],
)
def test_bad_arrays(array: np.ndarray, message: str) -> None:
    exc = _exactly(DecodeError, image_from_object, array)
    assert re.search(message, str(exc)), str(exc)


@pytest.mark.parametrize("obj", [b"\x89PNG", "img.png", [[1, 2]], None])
def test_unsupported_objects(obj: Any) -> None:
    _exactly(InvalidSourceError, image_from_object, obj)


def test_pillow_blocks_are_kept_for_reuse() -> None:
    """The engine raises Pillow's block cache (never lowers it), so decodes reuse memory."""
    from aiomm.config import EngineConfig
    from aiomm.tuning import tuned
    from aiomm.tuning.pillow import keep_pillow_blocks

    before = PIL.Image.core.get_blocks_max()
    try:
        assert keep_pillow_blocks(before + 3) == before + 3
        assert keep_pillow_blocks(1) == before + 3  # never lowered
        assert tuned(EngineConfig(transform_threads=3)).decode.pillow_blocks_kept == 12
        cfg = tuned(EngineConfig(decode=DecodeConfig(pillow_blocks_kept=0)))
        assert cfg.decode.pillow_blocks_kept == 0  # asked for explicitly: kept
        with pytest.raises(ValueError, match="pillow_blocks_kept"):
            DecodeConfig(pillow_blocks_kept=-1)
    finally:
        PIL.Image.core.set_blocks_max(before)
