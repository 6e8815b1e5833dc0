"""``image_ops``: Pillow images to ``H x W x 3`` uint8 (equal to numpy's view), the resize of
4-byte pixels (equal to the resize of the same three channels), and the scratch resize (equal to
``F.interpolate``, written into the thread's reused buffers)."""

from __future__ import annotations

import threading

import numpy as np
import PIL.Image
import pytest
import torch
import torch.nn.functional as F

from aiomm.processing import image_ops
from aiomm.processing.image_ops import (
    Backend,
    Resample,
    as_tensor_view,
    padded_pixels,
    resize,
    resize_chw,
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


def interpolated(chw: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """What the torchvision backend computes (the reference of the scratch resize)."""
    return F.interpolate(
        chw.unsqueeze(0), size=(height, width), mode=mode, align_corners=False, antialias=True
    )[0]


@pytest.mark.parametrize("resample", [Resample.BILINEAR, Resample.BICUBIC])
@pytest.mark.parametrize("channels", [3, 4])
@pytest.mark.parametrize(
    ("shape", "target"),
    [
        ((37, 53), (28, 56)),  # both passes, one up and one down
        ((512, 506), (504, 504)),
        ((9, 300), (9, 140)),  # horizontal only
        ((300, 9), (140, 9)),  # vertical only
        ((1, 1), (28, 28)),
        ((21, 34), (21, 34)),  # nothing to do
    ],
)
def test_scratch_resize_equals_interpolate(
    resample: Resample, channels: int, shape: tuple[int, int], target: tuple[int, int]
) -> None:
    rng = np.random.default_rng(sum(shape) + channels)
    hwc = rng.integers(0, 256, (*shape, channels), dtype=np.uint8)
    chw = torch.from_numpy(hwc).permute(2, 0, 1)  # channels-last, as decoded pixels are
    mode = "bicubic" if resample is Resample.BICUBIC else "bilinear"
    out = resize_chw(chw, *target, resample, scratch=True)
    assert out.shape == (channels, *target) and out.dtype == torch.uint8
    assert torch.equal(out, interpolated(chw, *target, mode))


def test_scratch_resize_reuses_this_threads_buffer_and_not_another_threads() -> None:
    chw = torch.from_numpy(padded(40, 60, seed=1).base).permute(2, 0, 1)
    first = resize_chw(chw, 56, 84, Resample.BICUBIC, scratch=True)
    kept = first.clone()
    second = resize_chw(chw.flip(1), 56, 84, Resample.BICUBIC, scratch=True)
    # the contract: a scratch result lives until the next scratch resize in the same thread
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(second, interpolated(chw.flip(1), 56, 84, "bicubic"))
    assert not torch.equal(first, kept)
    elsewhere: list[torch.Tensor] = []
    thread = threading.Thread(
        target=lambda: elsewhere.append(resize_chw(chw, 56, 84, Resample.BICUBIC, scratch=True))
    )
    thread.start()
    thread.join()
    assert elsewhere[0].data_ptr() != second.data_ptr()
    assert torch.equal(elsewhere[0], kept)


def test_scratch_bytes_counts_each_threads_buffers_until_it_exits() -> None:
    chw = torch.from_numpy(padded(40, 60, seed=2).base).permute(2, 0, 1)
    ready, done = threading.Event(), threading.Event()
    keys: list[int] = []

    def work() -> None:
        resize_chw(chw, 280, 420, Resample.BICUBIC, scratch=True)
        keys.append(image_ops._scratch.holder.key)
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=work)
    thread.start()
    assert ready.wait(10)
    # this thread's two passes: 40 x 420, then 280 x 420 pixels of 4 bytes
    held = image_ops._held[keys[0]]
    counted = image_ops.scratch_bytes()
    done.set()
    thread.join()
    assert held == 4 * 420 * (40 + 280) and counted >= held
    assert keys[0] not in image_ops._held  # the thread's buffers went with it


def test_scratch_resize_falls_back_where_it_cannot_use_its_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hwc = np.random.default_rng(5).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    chw = torch.from_numpy(hwc).permute(2, 0, 1)
    expected = interpolated(chw, 20, 50, "bicubic")
    planar = chw.contiguous()  # channels-first: the kernel would repack it anyway
    assert torch.equal(resize_chw(planar, 20, 50, Resample.BICUBIC, scratch=True), expected)
    assert torch.equal(
        resize_chw(chw, 20, 50, Resample.NEAREST, scratch=True),
        F.interpolate(chw.unsqueeze(0), size=(20, 50), mode="nearest")[0],
    )
    monkeypatch.setattr(image_ops, "_SCRATCH_MAX_BYTES", 100)  # above the kept size
    fresh = resize_chw(chw, 20, 50, Resample.BICUBIC, scratch=True)
    assert torch.equal(fresh, expected)
    assert fresh.data_ptr() != resize_chw(chw, 20, 50, Resample.BICUBIC, scratch=True).data_ptr()


def test_scratch_resize_of_padded_pixels_equals_resize_of_three_channels() -> None:
    view = padded(333, 777, seed=9)
    out = resize(view, 336, 784, Resample.BICUBIC, Backend.TORCHVISION, scratch=True)
    expected = resize(np.ascontiguousarray(view), 336, 784, Resample.BICUBIC, Backend.TORCHVISION)
    assert out.shape == (3, 336, 784) and torch.equal(out, expected)


def test_scratch_resize_of_a_float_image_falls_back_to_interpolate() -> None:
    """The scratch buffers hold uint8: any other dtype takes the plain path, not an error."""
    hwc = np.random.default_rng(6).random((30, 40, 3), dtype=np.float32)
    chw = torch.from_numpy(hwc).permute(2, 0, 1)
    out = resize_chw(chw, 20, 50, Resample.BICUBIC, scratch=True)
    assert out.dtype == torch.float32 and torch.equal(out, interpolated(chw, 20, 50, "bicubic"))
