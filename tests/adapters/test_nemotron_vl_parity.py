"""Parity of the Llama Nemotron VL adapters with the published preprocessing they reproduce.

transformers has no processor for these architectures, so the reference here is an independent
re-statement, written for this test from vLLM's ``LlamaNemotronVLEmbedProcessor``
(``vllm/model_executor/models/nemotron_vl.py``: ``find_closest_aspect_ratio``,
``dynamic_preprocess_nemotron_vl``, ``build_siglip_transform``, ``get_image_repl``) in plain PIL
and torchvision transforms; it shares no code with the adapter. Every run draws fresh random
images (the seed is printed on failure) of many sizes and aspect ratios, 1 to 4 per prompt.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import parity
import PIL.Image
import pytest
import torch
import torchvision.transforms as T
from parity import SEED, rel_err

from aiomm.adapters import build_processor, get_adapter_info, supported_adapters
from aiomm.errors import ProcessorKwargsError, UnknownArchitectureError
from aiomm.processing.processor import MultiModalConfig
from aiomm.samples import photo_like

NAMES = ("llama-nemotron-vl-embed", "llama-nemotron-vl-rerank")
ARCHITECTURES = {
    "llama-nemotron-vl-embed": "LlamaNemotronVLForEmbedding",
    "llama-nemotron-vl-rerank": "LlamaNemotronVLForSequenceClassification",
}

# The published parameters (model cards / vLLM): 512 px tiles, SigLIP patch 16, pixel-shuffle 0.5.
TILE, TOKENS_PER_TILE = 512, (512 // 16) ** 2 // 4


# ------------------------------------------------------------------ the restated reference


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
        "to_tensor": torch.stack([T.ToTensor()(_PRE_NORM(t)) for t in tiles]),
        "float": torch.stack([_FLOAT(t) for t in tiles]),
    }


def reference_prompt(text: str, num_patches: list[int]) -> str:
    """vLLM's ``get_image_repl``: each ``<image>`` in turn becomes the image's token block."""
    for n in num_patches:
        repl = "<img>" + "<IMG_CONTEXT>" * (TOKENS_PER_TILE * n) + "</img>"
        text = text.replace("<image>", repl, 1)
    return text


# ------------------------------------------------------------------ helpers


@functools.cache
def reference_params(name: str) -> Any:
    return get_adapter_info(name).build_hf_processor()


SIZES = [(1, 1), (3, 5), (28, 28), (57, 33), (1, 150), (150, 1), (199, 3), (240, 320),
         (333, 500), (480, 640), (700, 20), (512, 512), (512, 1536), (1024, 512),
         (90, 610)]  # fmt: skip
SIZES_LARGE = [(1080, 1920), (1536, 2048), (2339, 1654)]


def draw_sizes(rng: random.Random, count: int, *, large: bool) -> list[tuple[int, int]]:
    pool = SIZES + (SIZES_LARGE if large else [])
    return parity.draw_sizes(rng, count, pool, random_side=1400)


def prompt_text(n_images: int) -> str:
    start, end = "<|start_header_id|>user<|end_header_id|>", "<|eot_id|>"
    return parity.prompt_text(n_images, "<image>", start=start, end=end)


def check_case(name: str, n_images: int, case_seed: int, *, large: bool) -> None:
    rng = random.Random(case_seed)
    nrng = np.random.default_rng(case_seed)
    sizes = draw_sizes(rng, n_images, large=large)
    images = [photo_like(nrng, h, w) for h, w in sizes]
    ctx = f"[{name} seed={case_seed} sizes={sizes}]"

    params = reference_params(name)
    tok = params.tokenizer
    text = prompt_text(n_images)
    ref = reference_outputs(images)
    expected_ids = tok(reference_prompt(text, ref["num_patches"]))["input_ids"]
    start, end, context = tok.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>"])

    out = build_processor(name, params).apply(tok(text)["input_ids"], {"image": images})
    merged = out.merged_kwargs()
    assert out.prompt_token_ids == expected_ids, f"{ctx}: token ids differ"
    assert merged["image_num_patches"].tolist() == ref["num_patches"], f"{ctx}: tile counts"

    ranges = out.mm_placeholders["image"]
    assert len(ranges) == n_images, ctx
    for r, n in zip(ranges, ref["num_patches"], strict=True):
        block = expected_ids[r.offset : r.offset + r.length]
        assert block == [start] + [context] * (TOKENS_PER_TILE * n) + [end], f"{ctx}: range"
        assert r.is_embed is not None and list(r.is_embed) == [t == context for t in block], ctx
        assert r.embed_count == TOKENS_PER_TILE * n, ctx
    covered = sorted(i for r in ranges for i in range(r.offset, r.offset + r.length))
    framed = [i for i, t in enumerate(expected_ids) if t in (start, end, context)]
    assert covered == framed, f"{ctx}: placeholder ranges"

    pv = merged["pixel_values"]
    assert pv.dtype == torch.uint8 and pv.shape == ref["uint8"].shape, f"{ctx}: {pv.shape}"
    assert torch.equal(pv, ref["uint8"]), f"{ctx}: uint8 pixel_values differ from the reference"
    assert torch.equal(pv.float().div(255), ref["to_tensor"]), f"{ctx}: != ToTensor output"

    norm = out.normalization
    assert norm is not None and norm.layout.name == "NCHW", ctx
    normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
    err = rel_err(normalised, ref["float"])
    assert err < 1e-6, f"{ctx}: normalised rel err {err:.3g}"


# ------------------------------------------------------------------ tests


def test_reference_restatement_matches_published_examples() -> None:
    """Sanity of the restated reference on grids worked out by hand from the published rule."""
    assert reference_grid(1000, 1000, 1, 6) == (2, 2)  # 4 tiles cover 60%: square wins
    assert reference_grid(100, 100, 1, 6) == (1, 1)  # small: every grid saturates, 1x1 first
    assert reference_grid(1920, 1080, 1, 6) == (3, 2)  # 6 tiles reach the 60% cap
    assert reference_grid(900, 300, 1, 6) == (3, 1)
    assert reference_grid(300, 900, 1, 1) == (1, 1)
    assert TOKENS_PER_TILE == 256


@pytest.mark.parametrize("name", NAMES)
def test_parity_random_images(name: str) -> None:
    rng = random.Random(f"{SEED}-{name}")
    for n_images in (1, 2, 3, 4):
        check_case(name, n_images, rng.randrange(2**31), large=False)


def test_parity_large_images() -> None:
    rng = random.Random(f"{SEED}-large")
    check_case("llama-nemotron-vl-embed", 2, rng.randrange(2**31), large=True)


def test_tile_kwargs_follow_the_reference() -> None:
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 700, 1500), photo_like(nrng, 2000, 300)]
    params = reference_params("llama-nemotron-vl-embed")
    proc = build_processor("llama-nemotron-vl-embed", params)
    ids = params.tokenizer(prompt_text(2))["input_ids"]
    for kwargs, ref_kwargs in (
        ({"max_dynamic_patch": 12}, {"max_num": 12}),
        ({"min_dynamic_patch": 2, "max_dynamic_patch": 4}, {"min_num": 2, "max_num": 4}),
        ({"dynamic_image_size": False}, {"min_num": 1, "max_num": 1}),
    ):
        out = proc.apply(ids, {"image": images}, kwargs)
        ref = reference_outputs(images, **ref_kwargs)
        pv = out.merged_kwargs()["pixel_values"]
        assert out.merged_kwargs()["image_num_patches"].tolist() == ref["num_patches"], kwargs
        assert torch.equal(pv, ref["uint8"]), f"{kwargs} seed={SEED}"
    with pytest.raises(ProcessorKwargsError):
        proc.apply(ids, {"image": images}, {"max_num_tiles": 3})
    with pytest.raises(ProcessorKwargsError):
        proc.apply(ids, {"image": images}, {"min_dynamic_patch": 5, "max_dynamic_patch": 2})


def test_items_do_not_depend_on_batching() -> None:
    nrng = np.random.default_rng(SEED + 1)
    images = [photo_like(nrng, 333, 1200), photo_like(nrng, 64, 48), photo_like(nrng, 900, 900)]
    proc = build_processor("llama-nemotron-vl-rerank", reference_params("llama-nemotron-vl-rerank"))
    batched = proc.process_items({"image": images}, {})["image"]
    for image, item in zip(images, batched, strict=True):
        alone = proc.process_items({"image": [image]}, {})["image"][0]
        assert torch.equal(item.data["pixel_values"], alone.data["pixel_values"]), SEED
        assert int(item.data["image_num_patches"]) == len(item.data["pixel_values"])


def test_classic_cpu_path_equals_reference_float() -> None:
    """With mm_device_do_normalize off, the output is the reference's float input exactly."""
    nrng = np.random.default_rng(SEED + 2)
    images = [photo_like(nrng, 97, 211), photo_like(nrng, 640, 480)]
    params = reference_params("llama-nemotron-vl-embed")
    config = MultiModalConfig(mm_device_do_normalize=False)
    proc = build_processor("llama-nemotron-vl-embed", params, config=config)
    out = proc.apply(params.tokenizer(prompt_text(2))["input_ids"], {"image": images})
    assert out.normalization is None
    pv = out.merged_kwargs()["pixel_values"]
    assert pv.dtype == torch.float32
    assert torch.equal(pv, reference_outputs(images)["float"]), f"seed={SEED}"


def test_only_the_native_transform_exists() -> None:
    params = reference_params("llama-nemotron-vl-embed")
    with pytest.raises(ValueError, match="no HF processor"):
        build_processor("llama-nemotron-vl-embed", params, config=MultiModalConfig(transform="hf"))
    assert build_processor("llama-nemotron-vl-embed", params).transform == "native"


def test_registry_lists_both_with_device_normalize_default() -> None:
    listed = {info.short_name: info for info in supported_adapters()}
    for name in NAMES:
        info = listed[name]
        assert info.architecture == ARCHITECTURES[name]
        assert get_adapter_info(info.architecture) is info
        assert info.mm_device_do_normalize is True
        assert build_processor(name).device_normalize is True
    with pytest.raises(UnknownArchitectureError):
        get_adapter_info("LlamaNemotronVLForCausalLM")
