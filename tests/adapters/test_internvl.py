"""adapters/internvl.py: InternVL 3 / 3.5's tiling against transformers' ``InternVLProcessor``
(``GotOcr2ImageProcessor`` and its PIL variant), and the prompt and items vLLM 0.33 builds."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from aiomm.adapters import build_processor, get_adapter_info
from aiomm.adapters.internvl import (
    InternVLMultiModalProcessor,
    build_hf_processor,
    select_tile_grid,
)
from aiomm.errors import ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.fields import FieldKind
from aiomm.processing.processor import MultiModalConfig

BACKENDS = ("torchvision", "pil")
#: tiny, thin and extreme, exact multiples of the tile (ties between grids), photos, 4K
SIZES = [
    (1, 1), (1, 2), (2, 1), (3, 5), (7, 1), (1, 600), (600, 1), (2, 600), (20, 2000),
    (2000, 20), (448, 448), (448, 896), (896, 448), (1344, 448), (448, 1344), (896, 896),
    (1000, 1000), (896, 1344), (300, 1000), (72, 96), (90, 150), (480, 640), (1080, 1920),
    (1920, 1080), (2160, 3840), (3840, 2160), (3024, 4032), (449, 447), (600, 2),
]  # fmt: skip
#: (min_patches, max_patches): the checkpoints', and other bounds the kwargs allow
BOUNDS = [(1, 12), (1, 6), (1, 4), (2, 9), (1, 1), (3, 3), (1, 40)]


@pytest.fixture(scope="module", params=BACKENDS)
def hf(request: pytest.FixtureRequest) -> object:
    return build_hf_processor(backend=request.param)


def _processor(hf: object, *, device: bool = True, mode: str = "native") -> object:
    config = MultiModalConfig(transform=mode, mm_device_do_normalize=device)
    return build_processor("internvl", hf, config=config)


def test_registered_with_the_checkpoints_parameters() -> None:
    info = get_adapter_info("InternVLForConditionalGeneration")
    assert info.short_name == "internvl"
    assert info.processor_cls is InternVLMultiModalProcessor
    assert "OpenGVLab/InternVL3-1B-hf" in info.example_models
    # vLLM's InternS1ForConditionalGeneration takes normalised pixels
    assert info.mm_device_do_normalize is False
    proc = build_hf_processor()
    ip = proc.image_processor
    assert (ip.size.height, ip.size.width, ip.min_patches, ip.max_patches) == (448, 448, 1, 12)
    assert proc.image_seq_length == 256


def test_tile_grid_equals_transformers_for_every_shape() -> None:
    """Aspect ratios from 1:4000 to 4000:1, exact ratios of every grid (the tie-break rule),
    and random sizes, under several tile bounds."""
    # imported here: the repository's kernels/ folder must not shadow HF's at collection
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    rng = random.Random(20261206)
    sizes = list(SIZES)
    sizes += [(r * k, c * k) for r, c in itertools.product(range(1, 13), repeat=2) for k in (1, 37)]
    sizes += [(448 * r, 448 * c) for r, c in itertools.product(range(1, 7), repeat=2)]
    sizes += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(800)]
    sizes += [(1, w) for w in range(1, 60)] + [(h, 1) for h in (1, 4000)]
    for (h, w), (lo, hi) in itertools.product(sizes, BOUNDS):
        ours = select_tile_grid(
            h, w, tile_height=448, tile_width=448, min_patches=lo, max_patches=hi
        )
        theirs = get_optimal_tiled_canvas((h, w), (448, 448), lo, hi)
        assert ours == theirs, (h, w, lo, hi)


def test_tie_break_prefers_more_tiles_while_the_image_fills_half_the_canvas() -> None:
    grid = {
        side: select_tile_grid(
            side, side, tile_height=448, tile_width=448, min_patches=1, max_patches=12
        )
        for side in (448, 633, 634, 950, 951)
    }
    # square images tie (1, 1), (2, 2) and (3, 3): 2 x 2 once the area exceeds half of 4 tiles
    # (633^2 < 401408 < 634^2), 3 x 3 once it exceeds half of 9 (950^2 < 903168 < 951^2)
    assert grid == {448: (1, 1), 633: (1, 1), 634: (2, 2), 950: (2, 2), 951: (3, 3)}


@pytest.mark.parametrize("kwargs", [{}, {"max_patches": 6}, {"min_patches": 2, "max_patches": 9}])
def test_tile_counts_equal_the_image_processor(hf: object, kwargs: dict[str, int]) -> None:
    ours = _processor(hf)
    params = ours._resolve_params(kwargs)
    merged = {"crop_to_patches": True, **kwargs}  # InternVLProcessor's default
    for h, w in SIZES:
        theirs = hf.image_processor.get_number_of_image_patches(h, w, merged)
        assert ours.num_tiles(h, w, params) == theirs, (h, w)
        assert int(ours.plan_image(h, w, kwargs).data["image_num_patches"]) == theirs


def _prompt(n_images: int) -> str:
    return "user " + " ".join(["<IMG_CONTEXT>"] * n_images) + " describe"


def _reference(hf: object, images: list[np.ndarray], **kwargs: object) -> dict[str, object]:
    return hf(text=[_prompt(len(images))], images=images, return_tensors="pt", **kwargs)


@pytest.mark.parametrize(
    "sizes",
    [[(1, 1)], [(2, 600), (600, 2)], [(20, 2000)], [(448, 896), (1000, 1000)], [(2160, 3840)],
     [(72, 96), (480, 640), (1, 2)]],
    ids=["1x1", "extreme", "1:100", "ties", "4k", "mixed"],
)  # fmt: skip
def test_tiles_equal_transformers(hf: object, sizes: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(sum(h * w for h, w in sizes))
    images = [photo_like(rng, h, w) for h, w in sizes]
    ref = _reference(hf, images, do_rescale=False, do_normalize=False)
    text_ids = hf.tokenizer("user " + " ".join(["<IMG_CONTEXT>"] * len(images)) + " describe")[
        "input_ids"
    ]
    for mode in ("native", "hf"):
        out = _processor(hf, mode=mode).apply(text_ids, {"image": images})
        pv = out.merged_kwargs()["pixel_values"]
        assert pv.dtype == torch.uint8
        assert torch.equal(pv.to(ref["pixel_values"].dtype), ref["pixel_values"]), mode
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), mode


def test_classic_path_equals_transformers_float_output(hf: object) -> None:
    rng = np.random.default_rng(3)
    images = [photo_like(rng, 300, 1000), photo_like(rng, 50, 40)]
    ref = _reference(hf, images)
    ids = hf.tokenizer(_prompt(2))["input_ids"]
    out = _processor(hf, device=False).apply(ids, {"image": images})
    assert out.normalization is None
    pv = out.merged_kwargs()["pixel_values"]
    assert pv.dtype == torch.float32 and torch.equal(pv, ref["pixel_values"])


@pytest.mark.parametrize(
    "kwargs",
    [{"crop_to_patches": False}, {"max_patches": 4}, {"min_patches": 3, "max_patches": 6},
     {"max_patches": 1}, {"size": {"height": 224, "width": 336}}],
)  # fmt: skip
def test_tiling_kwargs_equal_transformers(hf: object, kwargs: dict[str, object]) -> None:
    rng = np.random.default_rng(11)
    images = [photo_like(rng, 500, 1700), photo_like(rng, 90, 60)]
    ref = _reference(hf, images, do_rescale=False, do_normalize=False, **kwargs)
    ids = hf.tokenizer(_prompt(2))["input_ids"]
    out = _processor(hf).apply(ids, {"image": images}, kwargs)
    pv = out.merged_kwargs()["pixel_values"]
    assert torch.equal(pv.to(ref["pixel_values"].dtype), ref["pixel_values"])
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()


def test_prompt_and_items_as_vllm_builds_them() -> None:
    """vLLM's InternS1 processor: ``<IMG_CONTEXT>`` -> ``<img>`` + 256 x tiles ``<IMG_CONTEXT>``
    + ``</img>``, embeddings on the context tokens only; ``pixel_values`` flat over each image's
    tiles, ``image_num_patches`` batched."""
    hf = build_hf_processor()
    proc = _processor(hf)
    tok = hf.tokenizer
    start, end, context = tok.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>"])
    rng = np.random.default_rng(5)
    images = [photo_like(rng, 72, 96), photo_like(rng, 448, 448)]  # 4 x 3 + thumbnail, 1
    ids = tok("user <IMG_CONTEXT> and <IMG_CONTEXT> describe")["input_ids"]
    out = proc.apply(ids, {"image": images})
    first, second = out.mm_placeholders["image"]
    assert (first.length, second.length) == (13 * 256 + 2, 256 + 2)
    for r in (first, second):
        span = out.prompt_token_ids[r.offset : r.offset + r.length]
        assert span[0] == start and span[-1] == end and set(span[1:-1]) == {context}
        assert r.is_embed is not None
        assert list(r.is_embed) == [False] + [True] * (r.length - 2) + [False]
    items = out.mm_kwargs["image"]
    assert [int(i.data["image_num_patches"]) for i in items] == [13, 1]
    assert [tuple(i.data["pixel_values"].shape) for i in items] == [
        (13, 3, 448, 448),
        (1, 3, 448, 448),
    ]
    fields = items[0].fields
    assert fields["pixel_values"].kind is FieldKind.FLAT
    assert fields["image_num_patches"].kind is FieldKind.BATCHED
    plan = proc.plan_image(72, 96, {})
    assert torch.equal(plan.data["image_num_patches"], items[0].data["image_num_patches"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_patches": "four"}, "integer"), ({"min_patches": True}, "integer"),
     ({"size": {"shortest_edge": 448}}, "height"),
     ({"size": {"height": 0, "width": 448}}, "height")],
)  # fmt: skip
def test_bad_tiling_kwargs_are_refused(kwargs: dict[str, object], match: str) -> None:
    proc = _processor(build_hf_processor())
    with pytest.raises(ProcessorKwargsError, match=match):
        proc.plan_image(100, 100, kwargs)


def test_kwargs_the_transform_would_ignore_are_refused() -> None:
    proc = _processor(build_hf_processor())
    assert {"crop_to_patches", "min_patches", "max_patches"} <= proc.allowed_hf_kwargs()
    for key in ("do_resize", "do_convert_rgb", "do_rescale", "patch_size"):
        with pytest.raises(ProcessorKwargsError):
            proc.validate_hf_kwargs({key: 1})
