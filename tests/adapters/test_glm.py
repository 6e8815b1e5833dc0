"""GLM-V cases beyond the parity harness: processor kwargs that reach each resize branch,
GLM-5-Next's batch-independent canvas, and the errors."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from adapter_parity import check_case, prompt_text
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.errors import ItemCountMismatchError, ProcessingError, ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        # a small pixel budget: the scale-down branch of smart_resize on small images
        ("glm-4v", {"size": {"shortest_edge": 3136, "longest_edge": 50000}}),
        # a large minimum: the scale-up branch
        ("glm-ocr", {"size": {"shortest_edge": 400000, "longest_edge": 9633792}}),
        # a small token budget: GLM-5-Next's binary search down into the budget
        ("glm-5-next", {"max_image_tokens": 40}),
        # a large minimum: GLM-5-Next scales up small images and pads
        ("glm-5-next", {"min_image_tokens": 300}),
        # torchvision widens the canvas factor, PIL ignores it: both are reproduced
        ("glm-5-next", {"patch_expand_factor": 2}),
    ],
)
def test_parity_with_processor_kwargs(name: str, kwargs: dict[str, Any], backend: str) -> None:
    rng = random.Random(f"{SEED}-kwargs-{name}-{kwargs}-{backend}")
    check_case(name, backend, 3, rng.randrange(2**31), kwargs=kwargs)


def test_glm5_next_items_do_not_depend_on_the_batch() -> None:
    """An item processed alone equals the same item processed with others (what a cache keeps):
    GLM-5-Next pads each image to its own canvas, never to the batch's."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 120, 90), photo_like(nrng, 300, 410)]
    ours = build_processor("glm-5-next", hf_processor("glm-5-next", "torchvision"))
    together = ours.process_items({"image": images}, {})["image"]
    for image, item in zip(images, together, strict=True):
        alone = ours.process_items({"image": [image]}, {})["image"][0]
        for key in ("pixel_values", "image_grid_thw"):
            assert (alone.data[key] == item.data[key]).all(), f"{key} seed={SEED}"


def test_glm_ocr_reference_is_glm46v() -> None:
    assert type(hf_processor("glm-ocr", "pil")).__name__ == "Glm46VProcessor"


@pytest.mark.parametrize("mode", ["hf", "native"])
def test_fewer_placeholders_than_images(mode: str) -> None:
    proc = hf_processor("glm-4v", "torchvision")
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 40, 60), photo_like(nrng, 70, 50)]
    ours = build_processor("glm-4v", proc, config=MultiModalConfig(transform=mode))
    with pytest.raises(ItemCountMismatchError) as info:
        ours.apply(proc.tokenizer(prompt_text("glm-4v", 1))["input_ids"], {"image": images})
    assert info.value.num_items == 2 and info.value.num_placeholders == 1


@pytest.mark.parametrize("mode", ["hf", "native"])
def test_extreme_aspect_ratio_is_rejected(mode: str) -> None:
    proc = hf_processor("glm-4v", "pil")
    ours = build_processor("glm-4v", proc, config=MultiModalConfig(transform=mode))
    image = photo_like(np.random.default_rng(SEED), 2, 700)
    with pytest.raises(ProcessingError, match="aspect ratio"):
        ours.apply(proc.tokenizer(prompt_text("glm-4v", 1))["input_ids"], {"image": [image]})


def test_ignored_kwargs_are_rejected() -> None:
    ours = build_processor("glm-5-next", hf_processor("glm-5-next", "torchvision"))
    with pytest.raises(ProcessorKwargsError, match="size"):
        ours.validate_hf_kwargs({"size": {"shortest_edge": 1, "longest_edge": 2}})
    glm4v = build_processor("glm-4v", hf_processor("glm-4v", "torchvision"))
    glm4v.validate_hf_kwargs({"size": {"shortest_edge": 1, "longest_edge": 2}, "merge_size": 2})
    with pytest.raises(ProcessorKwargsError, match="min_image_tokens"):
        glm4v.validate_hf_kwargs({"min_image_tokens": 4})
