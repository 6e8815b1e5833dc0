"""Pieces shared by the adapter parity tests (``adapter_parity.py``, ``tests/adapters/``).

On ``sys.path`` through pytest's ``pythonpath`` setting (only this folder: the repository root
stays off the path, so ``kernels/`` can never be imported as a top-level ``kernels``).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from aiomm.adapters import get_adapter_info

__all__ = ("SEED", "draw_sizes", "hf_processor", "prompt_text", "rel_err")

#: fresh random inputs every run; ``AIOMM_TEST_SEED=<seed>`` replays a failure's seed
SEED = int(os.environ.get("AIOMM_TEST_SEED", time.time_ns() % 2**32))

_ORDINALS = ("first", "second", "third", "fourth")


@functools.cache
def hf_processor(name: str, backend: str = "torchvision") -> Any:
    """The reference HF processor of adapter ``name``, built once per backend."""
    return get_adapter_info(name).build_hf_processor(backend=backend)


def draw_sizes(
    rng: random.Random,
    count: int,
    pool: Sequence[tuple[int, int]],
    *,
    random_side: int = 900,
    max_aspect: float | None = None,
) -> list[tuple[int, int]]:
    """``count`` (height, width) sizes from ``pool``, one replaced by a fresh random size; sizes
    above ``max_aspect`` become square (processors that reject extreme aspect ratios)."""
    sizes = [rng.choice(pool) for _ in range(count)]
    sizes[rng.randrange(count)] = (rng.randint(1, random_side), rng.randint(1, random_side))
    if max_aspect is None:
        return sizes
    return [s if max(s) / min(s) <= max_aspect else (s[0], s[0]) for s in sizes]


def prompt_text(n_images: int, placeholder: str, *, start: str, end: str) -> str:
    """A one-turn prompt with ``n_images`` (at most 4) placeholders between words."""
    parts = [f"{start} describe the image"]
    parts += [f"{_ORDINALS[i]} {placeholder}" for i in range(n_images)]
    parts.append(f"what is in this picture {end}")
    return " ".join(parts)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against ``b``, in float64."""
    if a.numel() == b.numel() == 0:  # e.g. DeepSeek-OCR 2's local views of untiled images
        return 0.0
    a64, b64 = a.double(), b.double()
    return float(torch.linalg.vector_norm(a64 - b64) / torch.linalg.vector_norm(b64))
