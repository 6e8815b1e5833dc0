"""Patch layouts copied by numpy equal torch's permute-and-reshape for every dtype and stride."""

from __future__ import annotations

import pytest
import torch

from aiomm.processing import image_ops
from aiomm.processing.image_ops import copy_permuted, numpy_copyable, patchify


def _reference(chw: torch.Tensor, p: int, m: int, t: int) -> torch.Tensor:
    c, h, w = chw.shape
    x = chw.reshape(c, h // p // m, m, p, w // p // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
    return x.reshape((h // p) * (w // p), c * t * p * p)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temporal", [1, 2])
def test_patchify_equals_the_torch_layout(dtype: torch.dtype, temporal: int) -> None:
    hwc = torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8).to(dtype)
    chw = hwc.permute(2, 0, 1)  # a strided view, as a resize can return
    out = patchify(chw, patch_size=14, merge_size=2, temporal_patch_size=temporal)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, _reference(chw.contiguous(), 14, 2, temporal))


def test_copy_permuted_makes_an_owned_contiguous_tensor() -> None:
    x = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)
    out = copy_permuted(x, (2, 0, 1), (4, 6))
    assert torch.equal(out, x.permute(2, 0, 1).reshape(4, 6))
    out[0, 0] = 99  # a copy: the source is untouched
    assert x[0, 0, 0] == 0
    assert not numpy_copyable(torch.zeros(2, dtype=torch.bfloat16))
    assert not numpy_copyable(torch.zeros(2, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float32])
@pytest.mark.parametrize(
    "view",
    [
        lambda x: x,  # the last axis contiguous: copied as runs
        lambda x: x[..., ::2],  # a strided last axis: element by element
        lambda x: x[:, 1:, :],  # a sliced middle axis, the last still contiguous
    ],
)
@pytest.mark.parametrize("order", [(1, 2, 0, 3), (2, 0, 1, 3), (3, 0, 2, 1)])
def test_copy_permuted_equals_torch_for_every_layout(
    dtype: torch.dtype, view: object, order: tuple[int, ...]
) -> None:
    x = view(torch.arange(2 * 3 * 4 * 6).reshape(2, 3, 4, 6).to(dtype))  # type: ignore[operator]
    expected = x.permute(order).reshape(-1, x.shape[order[-1]])
    out = copy_permuted(x, order, expected.shape)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, expected)


def test_copy_permuted_of_a_scalar() -> None:
    assert torch.equal(copy_permuted(torch.tensor(5), (), ()), torch.tensor(5))


@pytest.mark.parametrize(
    ("h", "w", "p", "m"), [(28, 28, 14, 2), (56, 84, 14, 2), (84, 140, 14, 2), (64, 96, 16, 2),
                           (42, 14, 14, 1)],
)  # fmt: skip
@pytest.mark.parametrize("scratch", [True, False], ids=["scratch", "no-scratch"])
def test_patchify_of_rgb_in_four_byte_pixels_moves_whole_pixels(
    h: int, w: int, p: int, m: int, scratch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scratch resize's output (RGB bytes of 4-byte pixels) takes the pixel-run path; its
    rows equal the layout of the contiguous image, whatever the fourth bytes hold, and the
    view's storage may end at the last pixel's third byte. Without a scratch buffer (one above
    the size kept) the same, in memory of its own."""
    if not scratch:
        monkeypatch.setattr(image_ops, "_SCRATCH_MAX_BYTES", 0)
    rgbx = torch.randint(0, 256, (h, w, 4), dtype=torch.uint8)
    chw = torch.from_numpy(rgbx.numpy()[..., :3].transpose(2, 0, 1))  # storage: 4hw - 1 bytes
    assert chw.untyped_storage().nbytes() == 4 * h * w - 1
    assert image_ops._rgbx_view(chw, p * m) is not None
    out = patchify(chw, patch_size=p, merge_size=m, temporal_patch_size=1)
    assert out.is_contiguous() and out.dtype == torch.uint8
    assert torch.equal(out, _reference(chw.contiguous(), p, m, 1))
    rgbx[..., 3] = 255 - rgbx[..., 3]
    assert torch.equal(patchify(chw, patch_size=p, merge_size=m, temporal_patch_size=1), out)


@pytest.mark.parametrize(
    ("h", "w", "p", "m", "band_bytes"),
    [(140, 56, 14, 2, 1), (140, 56, 14, 2, 2 * 56 * 28 * 4), (96, 64, 16, 2, 3 * 64 * 32 * 4),
     (70, 28, 14, 1, 2 * 28 * 14 * 4)],
)  # fmt: skip
def test_patchify_of_four_byte_pixels_in_bands_equals_the_whole(
    h: int, w: int, p: int, m: int, band_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pixel runs go through the scratch buffer a band of window rows at a time: one row per
    band, several, and a last band shorter than the others give the same rows."""
    monkeypatch.setattr(image_ops, "_BAND_BYTES", band_bytes)
    rgbx = torch.randint(0, 256, (h, w, 4), dtype=torch.uint8)
    chw = torch.from_numpy(rgbx.numpy()[..., :3].transpose(2, 0, 1))
    out = patchify(chw, patch_size=p, merge_size=m, temporal_patch_size=1)
    assert torch.equal(out, _reference(chw.contiguous(), p, m, 1))


def test_patchify_takes_the_pixel_run_path_only_where_it_applies() -> None:
    rgbx = torch.randint(0, 256, (56, 84, 4), dtype=torch.uint8)
    assert image_ops._rgbx_view(rgbx[..., :3].permute(2, 0, 1), 28) is not None
    # not a multiple of a merge window; 3-byte pixels; two channels; a float view
    assert image_ops._rgbx_view(rgbx[:42, :, :3].permute(2, 0, 1), 28) is None
    assert image_ops._rgbx_view(rgbx[..., :3].contiguous().permute(2, 0, 1), 28) is None
    assert image_ops._rgbx_view(rgbx[..., :2].permute(2, 0, 1), 28) is None
    assert image_ops._rgbx_view(rgbx.float()[..., :3].permute(2, 0, 1), 28) is None
    # each falls back to the general copy, with the same layout
    chw = rgbx[..., :3].contiguous().permute(2, 0, 1)
    out = patchify(chw, patch_size=14, merge_size=2, temporal_patch_size=1)
    assert torch.equal(out, _reference(chw.contiguous(), 14, 2, 1))


def test_as_runs_views_a_contiguous_last_axis_as_whole_runs() -> None:
    import numpy as np

    a = np.arange(2 * 3 * 5, dtype=np.int16).reshape(2, 3, 5)
    runs = image_ops.as_runs(a)
    assert runs is not None and runs.shape == (2, 3) and runs.itemsize == 10
    assert np.shares_memory(runs, a)
    # a broadcast middle axis keeps its stride: copying the runs repeats whole rows
    wide = np.broadcast_to(a[:, :, None], (2, 3, 2, 5))
    out = np.empty(wide.shape, wide.dtype)
    np.copyto(image_ops.as_runs(out), image_ops.as_runs(wide))
    assert np.array_equal(out, wide)
    assert image_ops.as_runs(a.transpose(0, 2, 1)) is None  # last axis strided
    assert image_ops.as_runs(a[:, :, :0]) is None  # empty
    assert image_ops.as_runs(np.array(3)) is None  # 0-d
