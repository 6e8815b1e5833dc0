"""An independent re-statement of Llama Nemotron VL's published preprocessing (the reference).

transformers has no processor for these architectures, so this module restates vLLM's
``LlamaNemotronVLEmbedProcessor`` (``vllm/model_executor/models/nemotron_vl.py``:
``find_closest_aspect_ratio``, ``dynamic_preprocess_nemotron_vl``, ``build_siglip_transform``,
``get_image_repl``) in plain PIL and torchvision transforms; it shares no code with the adapter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import PIL.Image
import torch
import torchvision.transforms as T

__all__ = (
    "TILE",
    "TOKENS_PER_TILE",
    "reference_grid",
    "reference_outputs",
    "reference_prompt",
    "reference_tiles",
)

# The published parameters (model cards / vLLM): 512 px tiles, SigLIP patch 16, pixel-shuffle 0.5.
TILE, TOKENS_PER_TILE = 512, (512 // 16) ** 2 // 4


def reference_grid(width: int, height: int, min_num: int, max_num: int) -> tuple[int, int]:
    """vLLM's ``find_closest_aspect_ratio`` over ``get_nemotron_vl_target_ratios``."""
    ratios = set()
    for n in range(min_num, max_num + 1):
        for i in range(1, n + 1):
            for j in range(1, n + 1):
                if min_num <= i * j <= max_num:
                    ratios.add((i, j))
    aspect_ratio = width / height
    best_factor, best_ratio = float("-inf"), (1, 1)
    for ratio in sorted(ratios, key=lambda x: x[0] * x[1]):
        target = ratio[0] / ratio[1]
        size_factor = min((ratio[0] * ratio[1] * TILE * TILE) / (width * height), 0.6)
        factor = size_factor * min(target / aspect_ratio, aspect_ratio / target)
        if factor > best_factor:
            best_factor, best_ratio = factor, ratio
    return best_ratio


def reference_tiles(
    image: PIL.Image.Image, min_num: int = 1, max_num: int = 6, use_thumbnail: bool = True
) -> list[PIL.Image.Image]:
    """vLLM's ``dynamic_preprocess_nemotron_vl``: resize, crop row-major, thumbnail last."""
    cols, rows = reference_grid(image.width, image.height, min_num, max_num)
    resized = image.resize((TILE * cols, TILE * rows))
    tiles = []
    for i in range(cols * rows):
        left, top = (i % cols) * TILE, (i // cols) * TILE
        tiles.append(resized.crop((left, top, left + TILE, top + TILE)))
    if use_thumbnail and len(tiles) != 1:
        tiles.append(image.resize((TILE, TILE)))
    return tiles


_PRE_NORM = T.Compose(
    [
        T.Lambda(lambda img: img.convert("RGB")),
        T.Resize((TILE, TILE), interpolation=T.InterpolationMode.BICUBIC),
    ]
)
_FLOAT = T.Compose([_PRE_NORM, T.ToTensor(), T.Normalize(mean=(0.5,) * 3, std=(0.5,) * 3)])


def reference_outputs(images: list[PIL.Image.Image], **tile_kwargs: Any) -> dict[str, Any]:
    """Tiles per image; uint8 pixels before ToTensor; the float model input."""
    tiles_per_image = [reference_tiles(img, **tile_kwargs) for img in images]
    tiles = [t for ts in tiles_per_image for t in ts]
    uint8 = torch.stack([torch.from_numpy(np.array(_PRE_NORM(t))).permute(2, 0, 1) for t in tiles])
    return {
        "num_patches": [len(ts) for ts in tiles_per_image],
        "uint8": uint8,
        "float": torch.stack([_FLOAT(t) for t in tiles]),
    }


def reference_prompt(text: str, num_patches: list[int]) -> str:
    """vLLM's ``get_image_repl``: each ``<image>`` in turn becomes the image's token block."""
    for n in num_patches:
        repl = "<img>" + "<IMG_CONTEXT>" * (TOKENS_PER_TILE * n) + "</img>"
        text = text.replace("<image>", repl, 1)
    return text
