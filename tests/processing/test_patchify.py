"""Patch layouts copied by numpy equal torch's permute-and-reshape for every dtype and stride."""

from __future__ import annotations

import pytest
import torch

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
