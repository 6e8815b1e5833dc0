"""Llama Nemotron VL cases beyond the parity harness: the restated reference on hand-worked
grids, tile kwargs, batch-independent items, and the native-only transform.

The reference (``tests/support/nemotron_vl_reference.py``) is an independent re-statement of
vLLM's ``LlamaNemotronVLEmbedProcessor``; it shares no code with the adapter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from adapter_parity import prompt_text
from nemotron_vl_reference import TOKENS_PER_TILE, reference_grid, reference_outputs
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.errors import ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig

EMBED, RERANK = "llama-nemotron-vl-embed", "llama-nemotron-vl-rerank"


def test_reference_restatement_matches_published_examples() -> None:
    """Sanity of the restated reference on grids worked out by hand from the published rule."""
    assert reference_grid(1000, 1000, 1, 6) == (2, 2)  # 4 tiles cover 60%: square wins
    assert reference_grid(100, 100, 1, 6) == (1, 1)  # small: every grid saturates, 1x1 first
    assert reference_grid(1920, 1080, 1, 6) == (3, 2)  # 6 tiles reach the 60% cap
    assert reference_grid(900, 300, 1, 6) == (3, 1)
    assert reference_grid(300, 900, 1, 1) == (1, 1)
    assert TOKENS_PER_TILE == 256


def test_tile_kwargs_follow_the_reference() -> None:
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 700, 1500), photo_like(nrng, 2000, 300)]
    params = hf_processor(EMBED, "pil")
    proc = build_processor(EMBED, params)
    ids = params.tokenizer(prompt_text(EMBED, 2))["input_ids"]
    for kwargs, ref_kwargs in (
        ({"max_dynamic_patch": 12}, {"max_num": 12}),
        ({"min_dynamic_patch": 2, "max_dynamic_patch": 4}, {"min_num": 2, "max_num": 4}),
        ({"dynamic_image_size": False}, {"min_num": 1, "max_num": 1}),
    ):
        merged = proc.apply(ids, {"image": images}, kwargs).merged_kwargs()
        ref = reference_outputs(images, **ref_kwargs)
        assert merged["image_num_patches"].tolist() == ref["num_patches"], kwargs
        assert torch.equal(merged["pixel_values"], ref["uint8"]), f"{kwargs} seed={SEED}"
    with pytest.raises(ProcessorKwargsError):
        proc.apply(ids, {"image": images}, {"max_num_tiles": 3})
    with pytest.raises(ProcessorKwargsError):
        proc.apply(ids, {"image": images}, {"min_dynamic_patch": 5, "max_dynamic_patch": 2})


def test_items_do_not_depend_on_batching() -> None:
    nrng = np.random.default_rng(SEED + 1)
    images = [photo_like(nrng, 333, 1200), photo_like(nrng, 64, 48), photo_like(nrng, 900, 900)]
    proc = build_processor(RERANK, hf_processor(RERANK, "pil"))
    batched = proc.process_items({"image": images}, {})["image"]
    for image, item in zip(images, batched, strict=True):
        alone = proc.process_items({"image": [image]}, {})["image"][0]
        assert torch.equal(item.data["pixel_values"], alone.data["pixel_values"]), SEED
        assert int(item.data["image_num_patches"]) == len(item.data["pixel_values"])


def test_only_the_native_transform_exists() -> None:
    params = hf_processor(EMBED, "pil")
    with pytest.raises(ValueError, match="no HF processor"):
        build_processor(EMBED, params, config=MultiModalConfig(transform="hf"))
    assert build_processor(EMBED, params).transform == "native"
