"""DeepSeek-OCR 2 and DeepSeek-OCR (v1): the crop grid, the global view's geometry and the
token counts against vLLM's rules for many sizes, transformers' PIL image processor where it
agrees with vLLM, crop-mode kwargs against vLLM 0.33's render server (recorded with per-request
processor kwargs: ``fixtures_deepseek_ocr2/crop_modes``), DeepSeek-OCR's 640-px views, routing
plans, and errors.

The registry-driven harness (``tests/support/adapter_parity.py``) covers the default mode
against the restated reference (``tests/support/deepseek_ocr_reference.py``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from deepseek_ocr_reference import reference_num_tokens, reference_outputs
from parity import SEED
from PIL import ImageOps

from aiomm.adapters import build_processor
from aiomm.adapters.deepseek_ocr import (
    DeepseekOCRProcessor,
    DeepseekOCRReference,
    build_reference,
    build_reference_v1,
    global_view_geometry,
    num_image_tokens,
    select_crop_grid,
)
from aiomm.adapters.folders import CHAT_TEMPLATES
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig
from aiomm.types import Request
from aiomm.vllm.generate_request import WireForm, encode_items

RECORDED = Path(__file__).parents[1] / "server" / "fixtures_deepseek_ocr2" / "crop_modes"
RECORDED_CASES = sorted(p.stem for p in RECORDED.glob("*.json"))


def _sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(width, height): 640 and 768 multiples and neighbours, thin images, then random ones."""
    fixed = [(1, 1), (768, 768), (769, 768), (768, 769), (1536, 768), (768, 2304), (1537, 768),
             (2000, 20), (20, 2000), (1000, 798), (798, 1000), (1025, 1023), (640, 640),
             (641, 640), (640, 641), (1280, 640), (1281, 1920), (1920, 1280)]  # fmt: skip
    return fixed + [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(n)]


def _processor(name: str = "deepseek-ocr-2", **config: Any) -> DeepseekOCRProcessor:
    processor = build_processor(name, config=MultiModalConfig(**config))
    assert isinstance(processor, DeepseekOCRProcessor)
    return processor


def test_grids_and_token_counts_are_vllms() -> None:
    """Grids (max 6 and 9 crops, 640 and 768 px) and token counts of both models (strategies
    v2 and v1) equal vLLM's rules."""
    ref, ref_v1 = build_reference(), build_reference_v1()
    assert (ref_v1.image_size, ref_v1.strategy, ref_v1.base_size) == (640, "v1", 1024)
    rng = random.Random(f"{SEED}-grids")
    for width, height in _sizes(rng, 3000):
        assert num_image_tokens(width, height, ref) == reference_num_tokens(width, height)
        v1 = reference_num_tokens(width, height, "v1")
        assert num_image_tokens(width, height, ref_v1) == v1, (width, height)
        for size, most in ((768, 6), (640, 6), (768, 9)):
            ours = select_crop_grid(width, height, image_size=size, min_num=2, max_num=most)
            expected = _vllm_grid(width, height, size, most)
            assert ours == expected, (width, height, size, most)


def _vllm_grid(width: int, height: int, size: int, most: int) -> tuple[int, int]:
    from deepseek_ocr_reference import _closest

    return _closest(width, height, size, most)


def test_global_view_geometry_is_imageops_pad() -> None:
    """The resized size and the offset equal ``ImageOps.pad``'s (a white image on black, a
    64-px square: the pasted box is where the pixels are white)."""
    rng = random.Random(f"{SEED}-pad")
    for width, height in [(64, 64), (65, 64), (3, 200), (200, 3), (77, 50), (50, 77)] + [
        (rng.randint(1, 400), rng.randint(1, 400)) for _ in range(300)
    ]:
        white = PIL.Image.new("L", (width, height), 255)
        padded = np.asarray(ImageOps.pad(white, (64, 64), color=0))
        new_w, new_h, left, top = global_view_geometry(width, height, 64)
        rows, cols = np.nonzero(padded > 127)
        if new_w and new_h:
            box = (cols.min(), rows.min(), cols.max() + 1 - cols.min(), rows.max() + 1 - rows.min())
            assert box == (left, top, new_w, new_h), (width, height)


def test_transformers_pil_processor_agrees_but_for_half_pixel_centring() -> None:
    """transformers' ``DeepseekOcr2ImageProcessorPil`` makes the same local views, and the same
    global view unless centring it falls on a half pixel (vLLM's ``ImageOps.pad`` rounds half to
    even, transformers floors): the reason vLLM's processor is the reference."""
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import (
        DeepseekOcr2ImageProcessorPil,
    )

    hf = DeepseekOcr2ImageProcessorPil()
    processor = _processor(mm_device_do_normalize=True)
    nrng = np.random.default_rng(SEED)
    for height, width in [(700, 1001), (999, 1600), (400, 500), (798, 1000), (1000, 798)]:
        image = photo_like(nrng, height, width)
        ours = processor.process_items({"image": [image]}, {})["image"][0].data
        theirs = hf(image, do_rescale=False, do_normalize=False, return_tensors="pt")
        same_centre = all(
            round(d * 0.5) == d // 2
            for d in (1024 - v for v in global_view_geometry(width, height, 1024)[:2])
        )
        equal = torch.equal(ours["pixel_values"], theirs["pixel_values"][0].to(torch.uint8))
        assert equal == same_centre, (height, width)
        local = theirs.get("pixel_values_local")
        if local is not None:
            assert torch.equal(ours["images_crop"], (local / 255 - 0.5) / 0.5), (height, width)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"crop_mode": False},
        {"crop_mode": False, "base_size": 1280},
        {"image_size": 640},
        {"max_crops": 1},  # no grid has 2 to 1 views: vLLM cuts none
    ],
    ids=["base", "large", "small-tiles", "one-crop"],
)
def test_crop_modes_equal_the_reference(kwargs: dict[str, Any]) -> None:
    """Views and grids under crop-mode kwargs equal the restated reference; the token counts
    stay vLLM's fixed ones."""
    processor = _processor()
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, h, w) for h, w in ((300, 500), (900, 1400), (1300, 700))]
    out = processor.apply([5, processor.image_token_id] * 3, {"image": images}, kwargs)
    ref = reference_outputs(images, **kwargs)
    merged = out.merged_kwargs()
    assert torch.equal(merged["pixel_values"], ref["float"])
    assert torch.equal(merged["images_crop"], ref["images_crop"])
    assert torch.equal(merged["images_spatial_crop"], ref["images_spatial_crop"])
    assert [r.length for r in out.mm_placeholders["image"]] == ref["tokens"]
    assert all(r.is_embed is None for r in out.mm_placeholders["image"])


def test_deepseek_ocr_v1_equals_the_reference() -> None:
    """DeepSeek-OCR's row: 640-px local views (untiled, 2 x 1, 1 x 3 and 3 x 2 grids)
    and strategy v1's token counts equal the restated reference's."""
    processor = _processor("deepseek-ocr")
    nrng = np.random.default_rng(SEED)
    sizes = ((500, 640), (641, 1300), (1900, 700), (700, 1000))
    images = [photo_like(nrng, h, w) for h, w in sizes]
    out = processor.apply([5, processor.image_token_id] * len(images), {"image": images}, {})
    ref = reference_outputs(images, strategy="v1")
    merged = out.merged_kwargs()
    assert torch.equal(merged["pixel_values"], ref["float"])
    assert torch.equal(merged["images_crop"], ref["images_crop"])
    assert merged["images_spatial_crop"].tolist() == [[1, 1], [2, 1], [1, 3], [3, 2]]
    assert torch.equal(merged["images_spatial_crop"], ref["images_spatial_crop"])
    assert [r.length for r in out.mm_placeholders["image"]] == ref["tokens"]


def test_a_folder_gives_its_architectures_parameters(tmp_path: Path) -> None:
    """``from_pretrained`` of a model folder takes the parameters vLLM gives the architecture
    its ``config.json`` names."""
    from aiomm.adapters.folders import write_model_folder

    for name, size, strategy in (("deepseek-ocr", 640, "v1"), ("deepseek-ocr-2", 768, "v2")):
        ref = DeepseekOCRReference.from_pretrained(write_model_folder(name, tmp_path / name))
        assert (ref.image_size, ref.strategy) == (size, strategy), name


def _decoded(url: str) -> PIL.Image.Image:
    return PIL.Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@pytest.mark.parametrize("name", RECORDED_CASES)
def test_crop_modes_render_as_vllm(name: str) -> None:
    """Token ids, ranges and items (bytes, via their digests) of a request with crop-mode
    kwargs equal vLLM's render server's (started with ``--trust-request-mm-kwargs``)."""
    case = json.loads((RECORDED / f"{name}.json").read_text())
    body, response = case["body"], case["response"]
    processor = _processor()
    tokenizer = processor.hf_processor.tokenizer
    conversation, images = [], []
    for message in body["messages"]:
        content = message["content"]
        for part in content:
            if part["type"] == "image_url":
                images.append(_decoded(part["image_url"]["url"]))
        content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        conversation.append({"role": message["role"], "content": content})
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=CHAT_TEMPLATES["DeepseekOCRReference"],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert case["status"] == 200, name
    out = processor.apply(ids, {"image": images}, body["mm_processor_kwargs"])
    assert out.prompt_token_ids == response["token_ids"], name
    ranges = [{"offset": r.offset, "length": r.length} for r in out.mm_placeholders["image"]]
    assert ranges == response["features"]["mm_placeholders"]["image"], name
    items, metadata = encode_items(
        out.mm_kwargs["image"], WireForm.of(processor), float_dtype=torch.bfloat16
    )
    recorded = response["features"]["kwargs_data"]["image"]
    for i, (item, digest) in enumerate(zip(items, recorded, strict=True)):
        sent = str(item)
        assert len(sent) == digest["chars"], f"{name}: item {i} length"
        assert hashlib.sha256(sent.encode()).hexdigest() == digest["sha256"], f"{name}: item {i}"
    assert [str(m) for m in metadata] == response["features"]["mm_metadata"]["image"], name


@pytest.mark.anyio
async def test_routing_plans_equal_the_render() -> None:
    """``Engine.plan`` (image headers only) gives the full render's ids, ranges and grids, also
    with crops off (whose token counts stay vLLM's fixed ones)."""
    processor = _processor()
    nrng = np.random.default_rng(SEED)
    images = []
    for height, width in ((300, 500), (900, 1400), (2000, 20)):
        buf = io.BytesIO()
        photo_like(nrng, height, width).save(buf, "PNG")
        images.append(buf.getvalue())
    image_id = processor.image_token_id
    config = EngineConfig(return_items=True)
    async with Engine(processor, config) as engine:
        for kwargs in ({}, {"crop_mode": False}):
            request = Request(
                [7, image_id, 8, image_id, image_id], images, mm_processor_kwargs=kwargs
            )
            full = await engine.process(request, device=False)
            plan = await engine.plan(request)
            assert plan.prompt_token_ids == full.prompt_token_ids
            assert plan.mm_placeholders == full.mm_placeholders
            for planned, item in zip(plan.items, full.items, strict=True):
                grid = item.data["images_spatial_crop"]
                assert torch.equal(planned.data["images_spatial_crop"], grid)


def test_unknown_kwargs_and_bad_values_are_refused() -> None:
    processor = _processor()
    image = photo_like(np.random.default_rng(0), 40, 50)
    with pytest.raises(ProcessorKwargsError, match="strategy"):
        processor.apply([processor.image_token_id], {"image": [image]}, {"strategy": "v1"})
    with pytest.raises(ProcessorKwargsError, match="positive"):
        processor.apply([processor.image_token_id], {"image": [image]}, {"base_size": 0})
    with pytest.raises(ValueError, match="no HF processor"):
        _processor(transform="hf")
