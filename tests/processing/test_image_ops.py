"""``image_ops``: Pillow images to ``H x W x 3`` uint8 (equal to numpy's view), and the resize of
4-byte pixels (equal to the resize of the same three channels)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from aiomm.processing.image_ops import (
    Backend,
    Resample,
    as_tensor_view,
    padded_pixels,
    resize,
    to_rgb_array,
)


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


def padded(height: int, width: int, seed: int = 0) -> np.ndarray:
    """The first three channels of a random ``H x W x 4`` array (what decode_image returns)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, 4), dtype=np.uint8)[:, :, :3]


def test_padded_pixels_only_of_a_prefix_of_contiguous_4_byte_pixels() -> None:
    rgbx = np.zeros((5, 7, 4), np.uint8)
    assert padded_pixels(rgbx[:, :, :3]) is rgbx
    assert padded_pixels(np.ascontiguousarray(rgbx[:, :, :3])) is None  # its own base
    assert padded_pixels(rgbx[:, :, 1:]) is None  # not the first three channels
    assert padded_pixels(rgbx[1:, :, :3]) is None  # a crop: not the whole array
    wide = np.zeros((5, 14, 4), np.uint8)
    assert padded_pixels(wide[:, ::2, :3]) is None  # pixels 8 bytes apart
    assert padded_pixels(rgbx) is None  # four channels themselves
    assert padded_pixels(np.zeros((5, 7, 3), np.uint8)) is None


@pytest.mark.parametrize("resample", [Resample.BILINEAR, Resample.BICUBIC, Resample.NEAREST])
@pytest.mark.parametrize(
    ("shape", "target"), [((37, 53), (28, 56)), ((512, 506), (504, 504)), ((9, 300), (28, 140))]
)
def test_resize_of_padded_pixels_equals_resize_of_three_channels(
    resample: Resample, shape: tuple[int, int], target: tuple[int, int]
) -> None:
    view = padded(*shape, seed=shape[0])
    assert padded_pixels(view) is not None
    out = resize(view, *target, resample, Backend.TORCHVISION)
    expected = resize(np.ascontiguousarray(view), *target, resample, Backend.TORCHVISION)
    assert out.shape == (3, *target) and out.dtype == torch.uint8
    assert torch.equal(out, expected)
    # and the PIL backend, which takes the three channels as they are
    pil = resize(view, *target, resample, Backend.PIL)
    assert torch.equal(pil, resize(np.ascontiguousarray(view), *target, resample, Backend.PIL))


def test_resize_of_padded_pixels_at_their_own_size_is_a_view() -> None:
    view = padded(28, 56)
    out = resize(view, 28, 56, Resample.BICUBIC, Backend.TORCHVISION)
    assert out.data_ptr() == view.ctypes.data
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(view)).permute(2, 0, 1))
