"""SmolVLM cases beyond the parity harness: the sub-image grid against transformers' count over
many sizes, the prompt expansion against the processor's (SmolVLM names its global tag
otherwise than Idefics3), SmolVLM's smaller checkpoints' 512-px sub-images, the wire form and the
refusal of videos."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.adapters.idefics3 import grid
from aiomm.errors import AiommError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig
from aiomm.vllm.generate_request import WireForm

NAME = "smolvlm"
SIDE = 384
#: SmolVLM2-256M / 500M's image processor: 512-px sub-images, the longest edge to 2048
SMALL_CHECKPOINTS = {"max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048}}


def _sizes(rng: random.Random) -> list[tuple[int, int]]:
    edges = [1, 2, 3, 191, 192, 383, 384, 385, 767, 768, 769, 1152, 1536, 1537, 4096, 5000]
    sizes = [(h, w) for h in edges for w in edges]
    sizes += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(400)]
    sizes += [(rng.randint(1, 60), rng.randint(1, 8000)) for _ in range(100)]
    return sizes


@pytest.mark.parametrize("kwargs", [{}, SMALL_CHECKPOINTS])
def test_the_grid_is_the_one_vllm_counts_and_the_transforms(kwargs: dict[str, Any]) -> None:
    """vLLM counts each image's sub-images with ``get_number_of_image_patches``; the adapter's
    grid and count equal it for every size, and so does the split the transform makes."""
    proc = build_processor(NAME)
    ip = proc.image_processor
    params = proc._resolve_params(kwargs)
    side = kwargs.get("max_image_size", {}).get("longest_edge", SIDE)
    for height, width in _sizes(random.Random(f"{SEED}-{side}")):
        patches, rows, cols = ip.get_number_of_image_patches(height, width, kwargs)
        assert proc.image_grid(height, width, params) == (rows, cols), (height, width)
        assert proc.num_patches(height, width, params) == max(patches, 1), (height, width)
        split = grid(*proc.encoder_size(height, width, params), side)
        assert split == (rows, cols), (height, width)


@pytest.mark.parametrize(("rows", "cols"), [(0, 0), (1, 2), (4, 4), (3, 1)])
def test_the_image_text_is_the_processors(rows: int, cols: int) -> None:
    ref = hf_processor(NAME)
    proc = build_processor(NAME, ref)
    assert proc.global_token == ref.global_image_token == "<global-img>"
    want = ref.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
    assert proc.image_text(rows, cols) == want
    details = proc.image_tokens(rows, cols)
    assert list(details.full) == ref.tokenizer.encode(want, add_special_tokens=False)
    assert details.is_embed == tuple(t == ref.image_token_id for t in details.full)
    assert sum(details.is_embed) == (rows * cols + 1) * 81


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("kwargs", [{"do_image_splitting": False}, SMALL_CHECKPOINTS])
def test_processor_kwargs_match_the_processor(backend: str, kwargs: dict[str, Any]) -> None:
    check_case(NAME, backend, 1, SEED, sizes=[(600, 250)], kwargs=kwargs, classic=True)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_classic_path_equals_the_processor(backend: str) -> None:
    check_case(NAME, backend, 2, SEED + 1, sizes=[(1, 1), (384, 1000)], classic=True)


def test_items_hold_a_bool_mask_sent_as_int64() -> None:
    proc = build_processor(NAME, config=MultiModalConfig(mm_device_do_normalize=True))
    images = [photo_like(np.random.default_rng(0), 40, 90)]
    ids = proc.hf_processor.tokenizer("user <image> assistant")["input_ids"]
    out = proc.apply(ids, {"image": images})
    (item,) = out.mm_kwargs["image"]
    assert list(item.data) == ["pixel_values", "num_patches", "pixel_attention_mask"]
    assert tuple(item.data["pixel_values"].shape) == (9, 3, SIDE, SIDE)
    assert item.data["pixel_attention_mask"].dtype == torch.bool
    assert item.prompt_data["grid"] == [2, 4]
    assert WireForm.of(proc).dtypes == {"pixel_attention_mask": torch.int64}


def test_the_plan_carries_the_grid() -> None:
    proc = build_processor(NAME)
    plan = proc.plan_image(40, 90, {})
    assert plan.prompt_data["grid"] == [2, 4]
    assert int(plan.data["num_patches"]) == 9


def test_videos_are_refused() -> None:
    """vLLM's SmolVLM takes images only (its processor's video processor is never called)."""
    proc = build_processor(NAME)
    assert set(proc.dummy_inputs.placeholders) == {"image"}
    frames = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    ids = proc.hf_processor.tokenizer("user <image> assistant")["input_ids"]
    with pytest.raises(AiommError):
        proc.apply(ids, {"video": [frames]})
