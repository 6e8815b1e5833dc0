"""An independent re-statement of Kimi-K2.5's image preprocessing as vLLM runs it (the reference).

vLLM's ``KimiK25ForConditionalGeneration`` uses its own ``KimiK25FusedVisionProcessor``
(``vllm/transformers_utils/processors/kimi_k25_vision_fused.py``: ``navit_resize_image``,
``resize_image``, the numba kernel ``_write_fused_patches`` with its normalising lookup table)
with the checkpoint's ``media_proc_cfg``, and counts an image's tokens with its
``media_tokens_calculator``. This module restates them in plain Pillow and numpy; it shares no
code with the adapter.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import PIL.Image
import torch

__all__ = ("reference_num_tokens", "reference_outputs", "reference_resize")

PATCH, MERGE, IN_PATCH_LIMIT, SIDE_LIMIT = 14, 2, 16384, 512
MEAN = STD = (0.5, 0.5, 0.5)


def reference_resize(width: int, height: int) -> dict[str, int]:
    """vLLM's ``navit_resize_image`` with Kimi-K2.5's ``media_proc_cfg``."""
    s1 = math.sqrt(IN_PATCH_LIMIT / (max(1.0, width // PATCH) * max(1.0, height // PATCH)))
    s2 = SIDE_LIMIT * PATCH / width
    s3 = SIDE_LIMIT * PATCH / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), SIDE_LIMIT * PATCH)
    new_h = min(max(1, int(height * scale)), SIDE_LIMIT * PATCH)
    factor = MERGE * PATCH
    pad_h = (factor - new_h % factor) % factor
    pad_w = (factor - new_w % factor) % factor
    return {
        "num_tokens": ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor),
        "new_width": new_w,
        "new_height": new_h,
        "pad_width": pad_w,
        "pad_height": pad_h,
    }


def reference_num_tokens(width: int, height: int) -> int:
    return reference_resize(width, height)["num_tokens"]


def _lut() -> np.ndarray:
    values = np.arange(256, dtype=np.float32)[:, None]
    mean = np.asarray(MEAN, dtype=np.float32)
    inv_std = 1.0 / np.asarray(STD, dtype=np.float32)
    return (values / 255.0 - mean[None, :]) * inv_std[None, :]


def _patches(image: PIL.Image.Image) -> tuple[np.ndarray, list[int]]:
    cfg = reference_resize(*image.size)
    resized = np.asarray(
        image.resize((cfg["new_width"], cfg["new_height"]), resample=PIL.Image.Resampling.BICUBIC)
    )
    padded_h = cfg["new_height"] + cfg["pad_height"]
    padded_w = cfg["new_width"] + cfg["pad_width"]
    canvas = np.zeros((padded_h, padded_w, 3), dtype=np.uint8)
    canvas[: cfg["new_height"], : cfg["new_width"]] = resized
    rows, cols = padded_h // PATCH, padded_w // PATCH
    patches = canvas.reshape(rows, PATCH, cols, PATCH, 3).transpose(0, 2, 4, 1, 3)
    return patches.reshape(rows * cols, 3, PATCH, PATCH), [1, rows, cols]


def reference_outputs(images: list[PIL.Image.Image]) -> dict[str, Any]:
    """vLLM's ``pixel_values`` (uint8, as with ``--mm-device-do-normalize``, and float32
    normalised), ``grid_thws`` and token counts of RGB ``images``."""
    per_image = [_patches(image.convert("RGB")) for image in images]
    uint8 = np.concatenate([p for p, _ in per_image])
    lut = _lut()
    normalised = lut[uint8, np.arange(3)[None, :, None, None]]
    return {
        "uint8": torch.from_numpy(uint8),
        "float": torch.from_numpy(np.ascontiguousarray(normalised)),
        "grid_thws": torch.tensor([g for _, g in per_image], dtype=torch.int64),
        "tokens": [reference_num_tokens(*image.size) for image in images],
    }
