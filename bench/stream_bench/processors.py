"""The processors every system shares: the reference HF one and aiomm's, built and warmed."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import PIL.Image
import torch

from aiomm.adapters import build_processor, get_adapter_info

from .workload import prompt_for

MODEL = "qwen2-vl"


def hf_processor() -> Any:
    """aiomm's offline Qwen2-VL HF processor: the reference every system is compared with."""
    return get_adapter_info(MODEL).build_hf_processor(backend="torchvision")


def aiomm_processor() -> Any:
    """aiomm's processor over :func:`hf_processor`, warmed."""
    processor = build_processor(MODEL, hf_processor())
    warm_processor(processor)
    return processor


def pil(data: bytes) -> PIL.Image.Image:
    """Encoded bytes decoded to an RGB Pillow image, as the HF baselines take them."""
    return PIL.Image.open(io.BytesIO(data)).convert("RGB")


def small_image() -> PIL.Image.Image:
    """A 128x96 gradient image for warm-up calls."""
    y, x = np.mgrid[0:96, 0:128].astype(np.float32)
    rgb = np.stack([x * 2, y * 2.6, (x + y) % 64 * 4], axis=-1)
    return PIL.Image.fromarray(rgb.clip(0, 255).astype(np.uint8))


def warm_processor(processor: Any) -> Any:
    """One small image through the transform and the normalisation (first calls are slow)."""
    ids = processor.hf_processor.tokenizer(prompt_for(1, "describe"), add_special_tokens=False)[
        "input_ids"
    ]
    out = processor.apply(ids, {"image": [np.asarray(small_image())]})
    if out.normalization is not None:
        norm = out.normalization
        norm.module().forward_native(
            out.merged_kwargs()["pixel_values"], torch.bfloat16, layout=norm.layout
        )
    return out
