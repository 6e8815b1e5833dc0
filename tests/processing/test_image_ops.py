"""``image_ops.to_rgb_array``: Pillow images to ``H x W x 3`` uint8, equal to numpy's view."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from aiomm.processing.image_ops import as_tensor_view, to_rgb_array


def photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(PIL.Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return PIL.Image.fromarray(pixels if bands > 1 else pixels[..., 0], mode)


@pytest.mark.parametrize(
    ("width", "height"), [(1, 1), (3, 2), (640, 480), (17_000, 3), (5, 4_000), (1_999, 1_001)]
)
def test_rgb_pixels_equal_numpy_view(width: int, height: int) -> None:
    image = photo(width, height, seed=width)
    out = to_rgb_array(image)
    assert out.shape == (height, width, 3) and out.flags.c_contiguous
    assert np.array_equal(out, np.asarray(image))
    assert as_tensor_view(out).shape == (height, width, 3)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_other_modes_convert_like_pillow(mode: str) -> None:
    image = photo(37, 23, "RGB", seed=3).convert(mode)
    # (RGBA here is opaque: compositing on white leaves the pixels as they are)
    assert np.array_equal(to_rgb_array(image), np.asarray(image.convert("RGB")))
