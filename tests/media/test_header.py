"""The header's decided size (:func:`aiomm.media.header.decided_size`) equals the decode's, for
both decoders (HF's rule and vLLM's, EXIF orientation applied), and is never given for a file the
decode would refuse: truncated, damaged, with trailing bytes (the bound in the module
docstring)."""

from __future__ import annotations

import io
import random

import numpy as np
import PIL.Image
import pytest
from fuzzing import FORMATS, corrupt, encoded

from aiomm.config import DecodeConfig
from aiomm.engine.stages import PillowDecoder
from aiomm.errors import AiommError
from aiomm.media.samples import photo_like
from aiomm.vllm.media import VllmDecoder

DECODERS = {"hf": PillowDecoder(DecodeConfig()), "vllm": VllmDecoder(DecodeConfig())}


def _outcome(decoder: PillowDecoder, data: bytes) -> tuple[str, object]:
    """What decoding gives: ("ok", (height, width)) or ("error", its class)."""
    try:
        return "ok", decoder.decode(data).shape[:2]
    except AiommError as exc:
        return "error", type(exc)


def _planned(decoder: PillowDecoder, data: bytes) -> tuple[str, object] | None:
    """What the header says: ("ok", size), ("error", class) for a refused header, None when
    it does not decide."""
    try:
        size = decoder.plan_size(data)
    except AiommError as exc:
        return "error", type(exc)
    return None if size is None else ("ok", size)


def _photo(width: int, height: int, seed: int = 0) -> PIL.Image.Image:
    return photo_like(np.random.default_rng(seed), height, width)


def _save(image: PIL.Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize(("fmt", "mode"), [(f, m) for f, ms in FORMATS.items() for m in ms])
def test_a_whole_image_is_decided_as_decoded(decoder: str, fmt: str, mode: str) -> None:
    dec = DECODERS[decoder]
    for seed, (width, height) in enumerate(((1, 1), (37, 19), (96, 200))):
        data = encoded(fmt, mode, width, height, seed)
        planned = _planned(dec, data)
        if fmt in ("JPEG", "PNG"):
            assert planned is not None, (fmt, mode)  # the formats the header decides
        if planned is not None:
            assert planned == _outcome(dec, data), (fmt, mode, width, height)


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_as_each_decoder_applies_it(decoder: str, orientation: int) -> None:
    dec = DECODERS[decoder]
    image = _photo(60, 24, orientation)
    exif = image.getexif()
    exif[0x0112] = orientation
    for fmt in ("JPEG", "PNG"):
        data = _save(image, fmt, exif=exif.tobytes())
        planned = _planned(dec, data)
        assert planned is not None, fmt
        assert planned == _outcome(dec, data), (fmt, orientation)
        swapped = decoder == "vllm" and orientation >= 5
        assert planned[1] == ((60, 24) if swapped else (24, 60))


def test_xmp_orientation_without_exif_is_read_as_pillow_reads_it() -> None:
    xmp = (
        b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/'
        b'22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
        b'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
    )
    data = _save(_photo(50, 20), "JPEG", xmp=xmp)
    dec = DECODERS["vllm"]
    assert _planned(dec, data) == _outcome(dec, data) == ("ok", (50, 20))


def test_png_metadata_after_the_image_data_is_decoded_to_be_read() -> None:
    # Pillow reads chunks after IDAT only when decoding: the header cannot say where vLLM's
    # rule finds its orientation
    image = _photo(30, 10)
    exif = image.getexif()
    exif[0x0112] = 6
    data = _save(image, "PNG")
    end = data.rindex(b"IEND") - 4
    payload = exif.tobytes()
    import struct
    import zlib

    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload
    chunk += struct.pack(">I", zlib.crc32(chunk[4:]))
    late = data[:end] + chunk + data[end:]
    assert DECODERS["vllm"].plan_size(late) is None
    assert DECODERS["vllm"].decode(late).shape[:2] == (30, 10)  # rotated by the late chunk
    assert DECODERS["hf"].plan_size(late) == (10, 30)  # HF's rule reads no orientation


def test_what_the_header_leaves_to_the_decode() -> None:
    photo = _photo(64, 48)
    progressive = _save(photo, "JPEG", progressive=True)
    whole = _save(photo, "JPEG")
    for data in (
        progressive,  # several scans: markers between them
        whole + b"trailer",  # bytes after EOI
        whole[:-1],  # EOI cut
        _save(photo, "GIF"),
        _save(photo, "WEBP"),
        _save(photo, "PNG")[:-12],  # IEND cut (the decode accepts it: decided by decoding)
    ):
        for dec in DECODERS.values():
            assert dec.plan_size(data) is None


@pytest.mark.parametrize("decoder", DECODERS)
def test_damaged_files_are_never_decided_otherwise_than_decoded(decoder: str) -> None:
    """Truncated, flipped, zeroed and appended files of every format the header decides: when
    it decides, the decode agrees (the exceptions are the bound of the module docstring: none
    met in these seeded cases)."""
    dec = DECODERS[decoder]
    rng = random.Random(5)
    decided = 0
    for case in range(600):
        fmt = rng.choice(("JPEG", "PNG"))
        if rng.random() < 0.5:
            data = encoded(
                fmt, rng.choice(FORMATS[fmt]), rng.randint(8, 90), rng.randint(8, 90), case
            )
        else:
            photo = _photo(rng.randint(16, 160), rng.randint(16, 160), case)
            data = _save(photo, fmt, **({"quality": rng.randint(40, 95)} if fmt == "JPEG" else {}))
        how = rng.choice(("truncate", "flip", "zero", "append"))
        bad = corrupt(data, how, rng.random(), rng.randrange(256))
        planned = _planned(dec, bad)
        if planned is None:
            continue
        decided += 1
        assert planned == _outcome(dec, bad), (case, fmt, how)
    assert decided > 50  # the header did decide many of them
