"""LLaVA-NeXT and LLaVA-OneVision cases beyond the parity harness: the anyres grid and the
placeholder counts against transformers' and vLLM's rules, items that hold their own patches and
merge into HF's padded batch, processor kwargs, and the errors."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case, prompt_text
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.adapters.llava import (
    LLAVA_NEXT_PINPOINTS,
    ONEVISION_PINPOINTS,
    fit_size,
    select_best_resolution,
    unpadded_features,
)
from aiomm.errors import (
    ConfigError,
    ProcessingError,
    ProcessorKwargsError,
    UnknownModalityError,
)
from aiomm.media.samples import photo_like
from aiomm.processing.fields import PaddedPatchesField, merge_items
from aiomm.processing.processor import MultiModalConfig

NAME = "llava-next"


def _sizes(n: int, seed: int) -> list[tuple[int, int]]:
    """Seeded image sizes: thin, square, pinpoint multiples and random ones."""
    rng = random.Random(seed)
    fixed = [(1, 1), (1, 1100), (1100, 1), (2, 600), (336, 336), (336, 672), (672, 336),
             (1008, 336), (337, 1009), (672, 673), (1080, 1920), (3000, 40)]  # fmt: skip
    return fixed + [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(n)]


def test_grid_and_fit_equal_transformers() -> None:
    from transformers.image_processing_utils import get_patch_output_size
    from transformers.image_processing_utils import select_best_resolution as hf_best

    for h, w in _sizes(400, SEED):
        best = select_best_resolution(h, w, LLAVA_NEXT_PINPOINTS)
        assert best == tuple(hf_best((h, w), LLAVA_NEXT_PINPOINTS)), (h, w, SEED)
        image = np.zeros((3, h, w), dtype=np.uint8)
        hf_fit = get_patch_output_size(image, best, input_data_format="channels_first")
        assert fit_size(h, w, *best) == tuple(hf_fit), (h, w, best, SEED)


def test_placeholder_count_equals_vllm_and_hf() -> None:
    """The count follows vLLM's ``get_num_image_tokens`` (restated from
    ``vllm/model_executor/models/llava_next.py``) and equals HF's processor's count."""
    proc = hf_processor(NAME, "torchvision")
    ours = build_processor(NAME, proc)
    for h, w in _sizes(300, SEED + 1):
        rows, cols = (v // 336 for v in select_best_resolution(h, w, LLAVA_NEXT_PINPOINTS))
        unpadded, newline = unpadded_features(h, w, 24, rows, cols)
        vllm_count = 24 * 24 + unpadded + newline  # CLIP's 577 minus the CLS ("default")
        assert ours.num_image_tokens(h, w) == vllm_count, (h, w)
        hf_count = proc._get_number_of_features(h, w, 336, 336) - 1
        assert vllm_count == hf_count, (h, w)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_parity_many_images(backend: str) -> None:
    """Up to four images of the harness's sizes (and pinpoint multiples), classic path too."""
    rng = random.Random(f"{SEED}-{NAME}-{backend}")
    for n_images in (1, 2, 3, 4):
        check_case(NAME, backend, n_images, rng.randrange(2**31), classic=n_images == 2)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_parity_large_and_thin_images(backend: str) -> None:
    check_case(NAME, backend, 3, SEED, sizes=[(1080, 1920), (1, 1100), (2000, 600)], classic=True)


@pytest.mark.parametrize("mode", ["hf", "native"])
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_items_hold_their_own_patches(backend: str, mode: str) -> None:
    """Items processed alone equal items processed in a padded batch, each holds only its own
    ``1 + rows * cols`` patches, and any merge of them reproduces HF's padded batch."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 900), photo_like(nrng, 500, 333), photo_like(nrng, 41, 41)]
    proc = hf_processor(NAME, backend)
    config = MultiModalConfig(transform=mode, mm_device_do_normalize=True)
    ours = build_processor(NAME, proc, config=config)
    batch = ours.process_items({"image": images}, {})["image"]
    alone = [ours.process_items({"image": [image]}, {})["image"][0] for image in images]
    for a, b, patches in zip(alone, batch, (4, 3, 3), strict=True):
        for key in ("pixel_values", "image_sizes"):
            assert torch.equal(a.data[key], b.data[key]), f"{backend}/{mode} seed={SEED}"
        for item in (a, b):  # no item keeps the padded batch alive
            pv = item.data["pixel_values"]
            assert pv.shape == (patches, 3, 336, 336), pv.shape
            assert pv.untyped_storage().nbytes() == pv.nbytes and pv.is_contiguous()
    for order in ([2, 0], [1, 2], [0, 1, 2], [2]):
        merged = merge_items([alone[i] for i in order])
        ref = proc(
            text=[prompt_text(NAME, len(order))], images=[images[i] for i in order],
            return_tensors="pt", do_rescale=False, do_normalize=False,
        )  # fmt: skip
        assert torch.equal(merged["pixel_values"], ref["pixel_values"]), f"{order} seed={SEED}"
        assert torch.equal(merged["image_sizes"], ref["image_sizes"]), f"{order} seed={SEED}"


def test_padded_patches_field_finish_and_errors() -> None:
    field = PaddedPatchesField(counts=(2, 1))
    batch = torch.arange(2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 3) + 1
    items = field.split("pixel_values", batch)
    assert [tuple(v.shape) for v in items] == [(2, 3), (1, 3)]
    merged = field.merge(items)
    assert torch.equal(merged[1, 1], torch.zeros(3)) and torch.equal(merged[0], batch[0])
    assert field.concat_parts(items) is None
    normalised = merged - 5  # the device stage turned the padding patch into -5
    assert torch.equal(field.finish(normalised, items)[1, 1], torch.zeros(3))
    with pytest.raises(ProcessingError, match="patch counts"):
        field.split("pixel_values", batch[:1])
    with pytest.raises(ProcessingError, match="patches where"):
        PaddedPatchesField(counts=(3, 1)).split("pixel_values", batch)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    "kwargs", [{"resample": 2}, {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}]
)
def test_processor_kwargs(backend: str, kwargs: dict[str, Any]) -> None:
    check_case(NAME, backend, 2, SEED, sizes=[(300, 500), (620, 90)], kwargs=kwargs, classic=True)


@pytest.mark.parametrize("key", ["image_grid_pinpoints", "size", "crop_size"])
def test_grid_kwargs_are_refused(key: str) -> None:
    """vLLM counts tokens from the model config's grid: a request may not change it."""
    ours = build_processor(NAME)
    with pytest.raises(ProcessorKwargsError, match=key):
        ours.apply([0], {"image": [photo_like(np.random.default_rng(0), 20, 20)]}, {key: None})


def test_plan_equals_the_processed_item() -> None:
    ours = build_processor(NAME)
    image = photo_like(np.random.default_rng(SEED), 123, 456)
    item = ours.process_items({"image": [image]}, {})["image"][0]
    plan = ours.plan_image(123, 456, {})
    assert torch.equal(plan.data["image_sizes"], item.data["image_sizes"])
    ids = [ours.image_token_id]
    assert (
        ours.assemble(ids, {"image": [plan]}).prompt_token_ids
        == ours.assemble(ids, {"image": [item]}).prompt_token_ids
    )


def test_sizes_that_disagree_are_a_config_error() -> None:
    proc = hf_processor(NAME, "torchvision")
    from aiomm.adapters.llava import build_hf_processor

    other = build_hf_processor(crop_size={"height": 224, "width": 224})
    with pytest.raises(ConfigError, match="crop_size"):
        build_processor(NAME, other)
    assert build_processor(NAME, proc).patch == 336


# ------------------------------------------------------------------------------- OneVision

ONEVISION = "llava-onevision"


def test_onevision_count_equals_vllm_and_hf() -> None:
    """OneVision's ``anyres_max_9`` count (vLLM's ``_get_num_unpadded_features``, restated from
    ``vllm/model_executor/models/llava_onevision.py``) equals HF's for single images, the way
    vLLM calls HF (a flat image list: every image patched)."""
    proc = hf_processor(ONEVISION, "torchvision")
    ours = build_processor(ONEVISION, proc)
    assert (ours.npatches, ours.base_features, ours.max_patches) == (27, 729, 9)
    for h, w in _sizes(300, SEED + 3):
        rows, cols = (v // 384 for v in select_best_resolution(h, w, ONEVISION_PINPOINTS))
        current_h, current_w = 27 * rows, 27 * cols
        if w / h > current_w / current_h:
            current_h -= 2 * ((current_h - int(round(h * (current_w / w), 7))) // 2)
        else:
            current_w -= 2 * ((current_w - int(round(w * (current_h / h), 7))) // 2)
        unpadded, newline = current_h * current_w, current_h
        ratio = math.sqrt(current_h * current_w / (9 * 27**2))
        if ratio > 1.1:
            unpadded = int(current_h // ratio) * int(current_w // ratio)
            newline = int(current_h // ratio)
        assert ours.num_image_tokens(h, w) == 729 + unpadded + newline, (h, w)
        assert ours.num_image_tokens(h, w) == proc._get_number_of_features(h, w, 384, 384)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_onevision_parity(backend: str) -> None:
    rng = random.Random(f"{SEED}-{ONEVISION}-{backend}")
    for n_images in (1, 2, 3):
        check_case(ONEVISION, backend, n_images, rng.randrange(2**31), classic=n_images == 2)
    sizes = [(1080, 1920), (1, 3000), (2304, 384)]
    check_case(ONEVISION, backend, 3, SEED, sizes=sizes, classic=True)


def test_onevision_items_merge_into_hfs_batch() -> None:
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 900), photo_like(nrng, 1000, 700)]
    proc = hf_processor(ONEVISION, "pil")
    config = MultiModalConfig(transform="native", mm_device_do_normalize=True)
    ours = build_processor(ONEVISION, proc, config=config)
    alone = [ours.process_items({"image": [image]}, {})["image"][0] for image in images]
    assert [int(a.data["pixel_values"].shape[0]) for a in alone] == [4, 7]
    merged = merge_items(alone)
    ref = proc(
        text=[prompt_text(ONEVISION, 2)], images=images, return_tensors="pt",
        do_rescale=False, do_normalize=False,
    )  # fmt: skip
    assert torch.equal(merged["pixel_values"], ref["pixel_values"]), f"seed={SEED}"


def test_onevision_videos_are_not_taken() -> None:
    """Only images: vLLM's video loader for OneVision is not reproduced."""
    ours = build_processor(ONEVISION)
    assert ours.supported_modalities == ("image",)
    with pytest.raises(UnknownModalityError):
        ours.apply([0], {"video": [np.zeros((2, 8, 8, 3), dtype=np.uint8)]})
