"""Mistral 3 cases beyond the parity harness: items hold their own unpadded image and merge
into HF's padded batch, processor kwargs, and the errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case, prompt_text
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.errors import ItemCountMismatchError, ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.fields import merge_items
from aiomm.processing.processor import MultiModalConfig

NAME = "mistral3"


def hf_uint8(proc: Any, n_images: int, images: list[Any]) -> Any:
    return proc(text=[prompt_text(NAME, n_images)], images=images, return_tensors="pt",
                do_rescale=False, do_normalize=False)  # fmt: skip


@pytest.mark.parametrize("mode", ["hf", "native"])
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_cached_items_do_not_depend_on_batch_padding(backend: str, mode: str) -> None:
    """Items processed alone equal items processed in a padded batch, each holds its own
    unpadded ``[C, h, w]`` image, and any merge of them reproduces HF's padded batch."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 200), photo_like(nrng, 500, 333), photo_like(nrng, 41, 41)]
    proc = hf_processor(NAME, backend)
    ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
    batch = ours.process_items({"image": images}, {})["image"]
    alone = [ours.process_items({"image": [image]}, {})["image"][0] for image in images]
    for a, b in zip(alone, batch, strict=True):
        for key in ("pixel_values", "image_sizes"):
            assert torch.equal(a.data[key], b.data[key]), f"{backend}/{mode} seed={SEED}"
        for item in (a, b):  # no item keeps the padded batch alive
            pv = item.data["pixel_values"]
            assert pv.shape == (3, *item.data["image_sizes"].tolist()), pv.shape
            assert pv.untyped_storage().nbytes() == pv.nbytes and pv.is_contiguous()
    for order in ([2, 0], [1, 2], [0, 1, 2]):
        merged = merge_items([alone[i] for i in order])
        ref = hf_uint8(proc, len(order), [images[i] for i in order])
        assert torch.equal(merged["pixel_values"], ref["pixel_values"]), f"{order} seed={SEED}"
        assert torch.equal(merged["image_sizes"], ref["image_sizes"]), f"{order} seed={SEED}"


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    "kwargs", [{"size": {"longest_edge": 224}}, {"size": {"height": 200, "width": 400}}]
)
def test_processor_kwargs(backend: str, kwargs: dict[str, Any]) -> None:
    """A smaller longest edge and a height/width bound give HF's output too."""
    check_case(NAME, backend, 2, SEED, sizes=[(300, 500), (620, 90)], kwargs=kwargs)


def test_patch_size_is_not_a_kwarg() -> None:
    ours = build_processor(NAME, hf_processor(NAME, "torchvision"))
    with pytest.raises(ProcessorKwargsError, match="patch_size"):
        ours.validate_hf_kwargs({"patch_size": 16})  # the processor overrides it


def test_more_images_than_placeholders() -> None:
    proc = hf_processor(NAME, "torchvision")
    images = [photo_like(np.random.default_rng(SEED), 30, 40)] * 2
    with pytest.raises(ItemCountMismatchError):
        build_processor(NAME, proc).apply(
            proc.tokenizer(prompt_text(NAME, 1))["input_ids"], {"image": images}
        )
