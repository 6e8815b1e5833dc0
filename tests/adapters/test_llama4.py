"""Llama 4 cases beyond the parity harness: the canvas and resize size against transformers'
own functions over many sizes, the prompt expansion against the processor's, items independent
of their batch, processor kwargs, and the errors."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.adapters.llama4 import best_fit_grid, supported_grids
from aiomm.errors import ItemCountMismatchError, ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig

NAME = "llama4"
TILE = 336


def _hf_layout(
    height: int, width: int, max_patches: int, to_max: bool
) -> tuple[tuple[int, int], tuple[int, int]]:
    """transformers' canvas and resize size for one image, as ``Llama4ImageProcessor._preprocess``
    computes them (its own functions and types)."""
    from transformers.image_utils import SizeDict
    from transformers.models.llama4 import image_processing_llama4 as hf

    size = SizeDict(height=TILE, width=TILE)
    possible = torch.tensor(hf.find_supported_resolutions(max_patches, size))
    image_size = torch.Size([height, width])
    target = hf.get_best_fit(image_size, possible, resize_to_max_canvas=to_max)
    if to_max:
        bound = target
    else:
        bound = (
            min(max(image_size[0], TILE), target[0]),
            min(max(image_size[1], TILE), target[1]),
        )
    new = hf.get_max_res_without_distortion(image_size, bound)
    grid = (int(target[0]) // TILE, int(target[1]) // TILE)
    return grid, (max(int(new[0]), 1), max(int(new[1]), 1))


def _sizes(rng: random.Random) -> list[tuple[int, int]]:
    edges = [1, 2, 3, 167, 168, 335, 336, 337, 671, 672, 673, 1007, 1008, 1009, 1344, 5376, 5377]
    sizes = [(h, w) for h in edges for w in edges]
    sizes += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(600)]
    sizes += [(rng.randint(1, 60), rng.randint(1, 8000)) for _ in range(100)]
    return sizes


@pytest.mark.parametrize(
    ("max_patches", "to_max"), [(16, False), (16, True), (5, False), (1, False)]
)
def test_canvas_and_resize_size_equal_transformers(max_patches: int, to_max: bool) -> None:
    rng = random.Random(f"{SEED}-{max_patches}-{to_max}")
    proc = build_processor(NAME, hf_processor(NAME))
    params = proc._resolve_params({"max_patches": max_patches, "resize_to_max_canvas": to_max})
    for height, width in _sizes(rng):
        grid, resized = _hf_layout(height, width, max_patches, to_max)
        where = proc.layout(height, width, params)
        assert (where.rows, where.cols) == grid, (height, width, SEED)
        assert (where.height, where.width) == resized, (height, width, SEED)
        assert (
            best_fit_grid(
                height, width, tile=TILE, max_patches=max_patches, resize_to_max_canvas=to_max
            )
            == grid
        )


@pytest.mark.parametrize("max_patches", [1, 2, 6, 12, 16, 30])
def test_grid_order_is_transformers(max_patches: int) -> None:
    from transformers.image_utils import SizeDict
    from transformers.models.llama4.image_processing_llama4 import find_supported_resolutions

    find_supported_resolutions.cache_clear()
    hf = find_supported_resolutions(max_patches, SizeDict(height=TILE, width=TILE))
    assert [(r * TILE, c * TILE) for r, c in supported_grids(max_patches)] == list(hf)


@pytest.mark.parametrize("grid", [(1, 1), (1, 2), (2, 1), (3, 5), (4, 4), (16, 1)])
def test_image_tokens_equal_the_processors_split(grid: tuple[int, int]) -> None:
    """vLLM's replacement is the processor's ``_prompt_split_image`` string, tokenized; only its
    ``<|patch|>`` tokens take embeddings."""
    hf = hf_processor(NAME)
    proc = build_processor(NAME, hf)
    text = hf._prompt_split_image(aspect_ratio=torch.tensor(grid), num_patches_per_chunk=144)
    want = hf.tokenizer.encode(text, add_special_tokens=False)
    assert proc.image_tokens(*grid, proc.patches_per_tile({})) == want
    item = proc.plan_image(grid[0] * TILE, grid[1] * TILE, {})
    (update,) = proc._get_prompt_updates({"image": 1}, {}, {"image": [item]})
    details = update.replacement(0)
    embeds = [t for t, e in zip(details.full, details.is_embed, strict=True) if e]
    assert embeds == [proc.patch_id] * (144 * (grid[0] * grid[1] + (grid != (1, 1))))


@pytest.mark.parametrize("mode", ["hf", "native"])
def test_items_do_not_depend_on_their_batch(mode: str) -> None:
    """An image's item (tiles, tile count, grid) is the same alone as in a batch, and equals
    its routing plan."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 700), photo_like(nrng, 500, 333), photo_like(nrng, 41, 41)]
    proc = build_processor(NAME, hf_processor(NAME), config=MultiModalConfig(transform=mode))
    batch = proc.process_items({"image": images}, {})["image"]
    for image, item in zip(images, batch, strict=True):
        (alone,) = proc.process_items({"image": [image]}, {})["image"]
        assert alone.data.keys() == item.data.keys() == {
            "pixel_values", "patches_per_image", "aspect_ratios"
        }  # fmt: skip
        for key, value in item.data.items():
            assert torch.equal(alone.data[key], value), f"{mode} {key} seed={SEED}"
        rows, cols = item.data["aspect_ratios"].tolist()
        assert item.data["pixel_values"].shape[0] == int(item.data["patches_per_image"])
        assert int(item.data["patches_per_image"]) == (1 if rows * cols == 1 else 1 + rows * cols)
        plan = proc.plan_image(image.height, image.width, {})
        for key, value in plan.data.items():
            assert torch.equal(value, item.data[key]), key


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_patches": 4},
        {"resize_to_max_canvas": True},
        {"size": {"height": 224, "width": 224}},
        {"image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25]},
    ],
)
def test_processor_kwargs(kwargs: dict[str, Any]) -> None:
    """Fewer tiles, the largest canvas, smaller tiles and another normalisation give HF's output
    too (classic path included)."""
    check_case(NAME, "torchvision", 2, SEED, sizes=[(300, 500), (620, 90)], kwargs=kwargs,
               classic=True)  # fmt: skip


def test_classic_path_is_bfloat16_as_hf() -> None:
    """The default (device normalisation off) gives HF's bfloat16 pixels bit for bit."""
    proc = build_processor(NAME, hf_processor(NAME))
    assert not proc.device_normalize
    image = photo_like(np.random.default_rng(SEED), 400, 700)
    out = proc.apply(proc.hf_processor.tokenizer.encode("the <|image|>"), {"image": [image]})
    ref = proc.hf_processor(text=["the <|image|>"], images=[image], return_tensors="pt")
    assert out.normalization is None
    pv = out.merged_kwargs()["pixel_values"]
    assert pv.dtype == torch.bfloat16 and torch.equal(pv, ref["pixel_values"])
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": {"height": 336, "width": 448}},
        {"size": {"shortest_edge": 336}},
        {"max_patches": 0},
        {"do_resize": False},
        {"patch_size": 16},
    ],
)
def test_refused_kwargs(kwargs: dict[str, Any]) -> None:
    proc = build_processor(NAME, hf_processor(NAME))
    image = photo_like(np.random.default_rng(SEED), 40, 50)
    with pytest.raises(ProcessorKwargsError):
        proc.apply(proc.hf_processor.tokenizer.encode("the <|image|>"), {"image": [image]}, kwargs)


def test_more_images_than_placeholders() -> None:
    proc = build_processor(NAME, hf_processor(NAME))
    images = [photo_like(np.random.default_rng(SEED), 40, 50)] * 2
    with pytest.raises(ItemCountMismatchError):
        proc.apply(proc.hf_processor.tokenizer.encode("the <|image|>"), {"image": images})
