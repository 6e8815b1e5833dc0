"""vLLM's media rule (VllmDecoder) next to aiomm's HF rule, the msgpack layout and mm_hash."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import PIL.ImageOps
import pytest

from aiomm.errors import DecodeError, ImageTooLargeError
from aiomm.media.image import decode_image
from aiomm.processing.image_ops import padded_pixels
from aiomm.vllm.media import VllmDecoder, load_image
from aiomm.vllm.mm_hash import image_mm_hash
from aiomm.vllm.wire import Field, decode_item, encode_item

MAX = 1 << 26


def _encode(image: PIL.Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgb(w: int, h: int) -> np.ndarray:
    return np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_exif_orientation_is_applied() -> None:
    image = PIL.Image.fromarray(_rgb(40, 20))
    exif = image.getexif()
    exif[0x0112] = 6
    data = _encode(image, "PNG", exif=exif.tobytes())
    out, converted = load_image(data, max_pixels=MAX)
    assert out.shape == (40, 20, 3) and not converted
    expected = np.asarray(PIL.ImageOps.exif_transpose(PIL.Image.open(io.BytesIO(data))))
    assert np.array_equal(out, expected)
    assert decode_image(data, max_pixels=MAX).shape == (20, 40, 3)  # the HF rule ignores EXIF


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_upright_rgb_comes_back_as_the_array_it_was_decoded_into(fmt: str) -> None:
    data = _encode(PIL.Image.fromarray(_rgb(30, 20)), fmt)
    out, converted = load_image(data, max_pixels=MAX)
    assert not converted and padded_pixels(out) is not None  # no copy after the decode
    assert np.array_equal(out, np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")))
    assert np.array_equal(out, decode_image(data, max_pixels=MAX))  # both rules agree here
    # a rotated JPEG is transposed into a copy of its own
    image = PIL.Image.fromarray(_rgb(30, 20))
    exif = image.getexif()
    exif[0x0112] = 8
    rotated = _encode(image, fmt, exif=exif.tobytes())
    out, converted = load_image(rotated, max_pixels=MAX)
    expected = np.asarray(PIL.ImageOps.exif_transpose(PIL.Image.open(io.BytesIO(rotated))))
    assert out.shape == (30, 20, 3) and np.array_equal(out, expected)


def test_rgba_composited_on_white() -> None:
    rgba = np.dstack([_rgb(8, 4), np.full((4, 8), 0, np.uint8)])
    rgba[0, 0, 3] = 255
    out, converted = load_image(_encode(PIL.Image.fromarray(rgba, "RGBA")), max_pixels=MAX)
    assert converted
    assert (out[1:] == 255).all() and np.array_equal(out[0, 0], rgba[0, 0, :3])


def test_sixteen_bit_grey_is_clipped_as_pillow_converts() -> None:
    grey = np.array([[0, 100, 255, 256, 40000]], np.uint16)
    data = _encode(PIL.Image.fromarray(grey))
    out, converted = load_image(data, max_pixels=MAX)
    assert converted
    assert out[0, :, 0].tolist() == [0, 100, 255, 255, 255]
    assert decode_image(data, max_pixels=MAX)[0, :, 0].tolist() == [0, 0, 0, 1, 156]


def test_palette_and_greyscale_convert() -> None:
    pal = PIL.Image.fromarray(_rgb(16, 16)).quantize(colors=8)
    out, converted = load_image(_encode(pal), max_pixels=MAX)
    assert converted and np.array_equal(out, np.asarray(pal.convert("RGB")))
    grey = PIL.Image.fromarray(_rgb(5, 5)[..., 0])
    out, converted = load_image(_encode(grey), max_pixels=MAX)
    assert converted and (out[..., 0] == out[..., 2]).all()


def _encode_as(image: PIL.Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def test_decoder_errors_are_typed() -> None:
    decoder = VllmDecoder()
    with pytest.raises(DecodeError):
        decoder.decode(b"\x89PNG garbage")
    data = _encode(PIL.Image.fromarray(_rgb(30, 30)))
    info = decoder.probe(data)
    assert (info.width, info.height) == (30, 30) and info.peak_bytes >= 30 * 30 * 3
    with pytest.raises(ImageTooLargeError):
        load_image(data, max_pixels=100)
    with pytest.raises(DecodeError, match="allowed"):  # the engine's format allow-list holds
        load_image(_encode_as(PIL.Image.fromarray(_rgb(8, 8)), "PPM"), max_pixels=MAX)


def test_codec_matches_vllm_test_vector() -> None:
    # shared/vllm_render/README.md: the 87-byte mm_metadata item of a 640x480 JPEG
    vector = (
        "ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAAIgAAAAAAAAAuAAAAAAAAAKVmaWVs"
        "ZJKnYmF0Y2hlZIGra2VlcF9vbl9jcHXD"
    )
    import torch

    grid = torch.tensor([1, 34, 46])
    assert encode_item({"image_grid_thw": (grid, Field("batched", {"keep_on_cpu": True}))}) == (
        vector
    )
    value, fld = decode_item(vector)["image_grid_thw"]
    assert value.array().tolist() == [1, 34, 46] and fld.kind == "batched"


def test_mm_hash_depends_on_bytes_model_and_mode() -> None:
    a = image_mm_hash(b"abc", "/m", mode_converted=False)
    assert len(a) == 64
    assert a != image_mm_hash(b"abd", "/m", mode_converted=False)
    assert a != image_mm_hash(b"abc", "/n", mode_converted=False)
    assert a != image_mm_hash(b"abc", "/m", mode_converted=True)


def test_fast_fidelity_stays_exact_with_vllms_rule() -> None:
    """The fast mode's reduced decode is Pillow's own; an engine decoding by vLLM's rule keeps
    exact decoding (and says so) instead of mixing the two."""
    from aiomm.adapters import build_processor
    from aiomm.config import DecodeConfig, EngineConfig
    from aiomm.engine import Engine

    config = EngineConfig(device="cpu", decode=DecodeConfig(fidelity="fast"))
    engine = Engine(build_processor("qwen2-vl"), config, decoder=VllmDecoder())
    assert engine.fidelity == "exact"
