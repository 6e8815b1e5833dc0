"""Property-based fuzzing of decode + transform (hypothesis): any image file, valid or damaged,
of any supported format, mode and size, either decodes to an ``H x W x 3`` uint8 array that the
adapter transforms, or fails with a typed AiommError; never another exception, never a hang."""

from __future__ import annotations

import numpy as np
import pytest
from fuzzing import FORMATS, corrupt, encoded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiomm.adapters import build_processor
from aiomm.errors import AiommError, DecodeError, ImageTooLargeError, ProcessingError
from aiomm.media.image import decode_image, probe_image

MAX_PIXELS = 4 * 2**20


@st.composite
def image_files(draw: st.DrawFn) -> tuple[bytes, str]:
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    mode = draw(st.sampled_from(FORMATS[fmt]))
    width = draw(st.one_of(st.integers(1, 40), st.sampled_from([1, 2, 199, 257, 1024])))
    height = draw(st.one_of(st.integers(1, 40), st.sampled_from([1, 3, 201, 255])))
    data = encoded(fmt, mode, width, height, draw(st.integers(0, 3)))
    how = draw(st.sampled_from(["none", "truncate", "flip", "zero", "append", "forge"]))
    if how != "none":
        data = corrupt(data, how, draw(st.floats(0, 1)), draw(st.integers(0, 255)))
    return data, f"{fmt}/{mode}/{width}x{height}/{how}"


@pytest.fixture(scope="module")
def processor():
    return build_processor("qwen2-vl")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)  # fmt: skip
@given(case=image_files())
def test_decode_and_transform_fail_only_typed(processor, case: tuple[bytes, str]) -> None:
    data, label = case
    try:
        info = probe_image(data, max_pixels=MAX_PIXELS, max_pixels_per_byte=8192)
        image = decode_image(data, max_pixels=MAX_PIXELS, max_pixels_per_byte=8192)
    except (DecodeError, ImageTooLargeError):
        return
    except Exception as exc:  # pragma: no cover - what the property forbids
        pytest.fail(f"{label}: untyped {type(exc).__name__}: {exc}")
    assert image.dtype == np.uint8 and image.shape == (info.height, info.width, 3), label
    try:
        out = processor.process_items({"image": [image]}, {}, validated=True)
    except ProcessingError:
        return  # e.g. an aspect ratio the model rejects
    except AiommError as exc:  # pragma: no cover
        pytest.fail(f"{label}: transform raised {type(exc).__name__}, not a ProcessingError")
    except Exception as exc:  # pragma: no cover
        pytest.fail(f"{label}: untyped {type(exc).__name__}: {exc}")
    assert out["image"][0] is not None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.binary(min_size=0, max_size=2048))
def test_arbitrary_bytes_fail_typed(data: bytes) -> None:
    with pytest.raises((DecodeError, ImageTooLargeError)):
        decode_image(b"\x89PNG\r\n\x1a\n" + data, max_pixels=MAX_PIXELS)
