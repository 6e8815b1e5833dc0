"""An independent re-statement of DeepSeek-OCR's preprocessing as vLLM runs it (the reference).

vLLM's ``DeepseekOCRForCausalLM`` and ``DeepseekOCR2ForCausalLM`` use its own
``DeepseekOCRProcessor`` (``vllm/transformers_utils/processors/deepseek_ocr.py``:
``find_closest_aspect_ratio``, ``calculate_aspect_ratios``, ``dynamic_preprocess``,
``ImageTransform``, ``tokenize_with_images``) with ``base_size=1024`` and 2..6 crops, and
``image_size`` 640 (strategy v1) or 768 (strategy v2); they count the tokens with
``DeepseekOCRProcessingInfo.get_num_image_tokens`` and ``DeepseekOCR2ProcessingInfo``'s. This
module restates them in plain PIL (``Image.resize``, ``ImageOps.pad``) and torchvision
transforms; it shares no code with the adapter.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import PIL.Image
import torch
import torchvision.transforms as T
from PIL import ImageOps

__all__ = ("reference_num_tokens", "reference_outputs")

BASE_SIZE, MIN_CROPS, MAX_CROPS = 1024, 2, 6
#: the model's ``IMAGE_SIZE`` per strategy (v1: DeepSeek-OCR, v2: DeepSeek-OCR 2)
IMAGE_SIZES = {"v1": 640, "v2": 768}
_TRANSFORM = T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])


def _ratios(min_num: int, max_num: int) -> list[tuple[int, int]]:
    ratios = set(
        (i, j)
        for n in range(min_num, max_num + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_num <= i * j <= max_num
    )
    return sorted(ratios, key=lambda x: x[0] * x[1])


def _closest(width: int, height: int, image_size: int, max_num: int) -> tuple[int, int]:
    aspect_ratio = width / height
    best_diff, best = float("inf"), (1, 1)
    for ratio in _ratios(MIN_CROPS, max_num):
        diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif (
            diff == best_diff
            and width * height > 0.5 * image_size * image_size * ratio[0] * ratio[1]
        ):
            best = ratio
    return best


def _crops(image: PIL.Image.Image, image_size: int, max_num: int) -> tuple[list[Any], list[int]]:
    cols, rows = _closest(image.width, image.height, image_size, max_num)
    resized = image.resize((image_size * cols, image_size * rows))
    tiles = []
    for i in range(cols * rows):
        left, top = (i % cols) * image_size, (i // cols) * image_size
        tiles.append(resized.crop((left, top, left + image_size, top + image_size)))
    return tiles, [cols, rows]


def reference_num_tokens(width: int, height: int, strategy: str = "v2") -> int:
    """vLLM's ``get_num_image_tokens`` (fixed parameters, whatever the processor kwargs)."""
    image_size = IMAGE_SIZES[strategy]
    cols, rows = 1, 1
    if width > image_size or height > image_size:
        cols, rows = _closest(width, height, image_size, MAX_CROPS)
    h = w = math.ceil((BASE_SIZE // 16) / 4)
    h2 = w2 = math.ceil((image_size // 16) / 4)
    if strategy == "v1":
        global_tokens = h * (w + 1)
        local_tokens = (rows * h2) * (cols * w2 + 1)
    else:
        global_tokens = h * w
        local_tokens = (rows * h2) * (cols * w2)
    return global_tokens + (local_tokens if cols > 1 or rows > 1 else 0) + 1


def reference_outputs(
    images: list[PIL.Image.Image],
    *,
    strategy: str = "v2",
    crop_mode: bool = True,
    base_size: int = BASE_SIZE,
    image_size: int | None = None,
    max_crops: int = MAX_CROPS,
) -> dict[str, Any]:
    """vLLM's ``tokenize_with_images`` pixels for the model of ``strategy`` (``image_size``
    and the other kwargs: a request's processor kwargs): the global views (uint8 and float), the
    local views (float), ``images_spatial_crop`` and each image's token count."""
    if image_size is None:
        image_size = IMAGE_SIZES[strategy]
    globals_u8, crops, spatial, tokens = [], [], [], []
    for image in images:
        image = image.convert("RGB")
        tokens.append(reference_num_tokens(image.width, image.height, strategy))
        tiles, ratio = [], [1, 1]
        if (image.width > image_size or image.height > image_size) and crop_mode:
            tiles, ratio = _crops(image, image_size, max_crops)
        if not crop_mode:
            image = image.resize((image_size, image_size))
        view = ImageOps.pad(image, (base_size, base_size), color=(127, 127, 127))
        globals_u8.append(torch.from_numpy(np.array(view)).permute(2, 0, 1))
        spatial.append(ratio)
        if ratio[0] > 1 or ratio[1] > 1:
            crops.extend(_TRANSFORM(t) for t in tiles)
    u8 = torch.stack(globals_u8)
    return {
        "uint8": u8,
        "float": torch.stack(
            [_TRANSFORM(PIL.Image.fromarray(g.permute(1, 2, 0).numpy())) for g in u8]
        ),
        "images_crop": torch.stack(crops) if crops else torch.zeros((0, 3, image_size, image_size)),
        "images_spatial_crop": torch.tensor(spatial, dtype=torch.long),
        "tokens": tokens,
    }
