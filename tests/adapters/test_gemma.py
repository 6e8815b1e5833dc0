"""Gemma 3: pan-and-scan crops against transformers', the transform with crops against the HF
processor on both backends, and prompts, ranges and items against vLLM 0.33's render server
(pan-and-scan cases recorded with per-request processor kwargs: ``fixtures_gemma3/pan_and_scan``).

The registry-driven harness (``tests/support/adapter_parity.py``) covers the checkpoint's default
(pan-and-scan off) on both backends; these tests cover what it does not.
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.adapters.folders import CHAT_TEMPLATES
from aiomm.adapters.gemma import (
    PROCESSOR_DEFAULTS,
    PanAndScan,
    merge_newlines,
    pan_and_scan_crops,
)
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import AiommError, ItemRejectedError, ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig
from aiomm.types import Request
from aiomm.vllm.generate_request import WireForm, encode_items

RECORDED = Path(__file__).parents[1] / "server" / "fixtures_gemma3" / "pan_and_scan"
RECORDED_CASES = sorted(p.stem for p in RECORDED.glob("*.json"))
BACKENDS = ("torchvision", "pil")
BOI = "<start_of_image>"


def _params(**kwargs: Any) -> PanAndScan:
    defaults = {
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 256,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    return PanAndScan(**{**defaults, **kwargs})  # type: ignore[arg-type]


def _sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    fixed = [(1, 1), (1, 700), (700, 1), (256, 309), (300, 1000), (1000, 300), (512, 1536),
             (257, 2000), (2000, 257), (600, 719), (720, 600), (99, 1000)]  # fmt: skip
    return fixed + [(rng.randint(1, 2500), rng.randint(1, 2500)) for _ in range(n)]


@pytest.mark.parametrize(
    "params",
    [
        _params(),
        _params(pan_and_scan_min_crop_size=32),
        _params(pan_and_scan_min_crop_size=100, pan_and_scan_max_num_crops=7),
        _params(pan_and_scan_min_crop_size=1, pan_and_scan_max_num_crops=2),
        _params(pan_and_scan_min_ratio_to_activate=3.0, pan_and_scan_min_crop_size=50),
    ],
)
def test_pan_and_scan_crops_are_transformers(params: PanAndScan) -> None:
    """Crop boxes equal ``Gemma3ImageProcessorPil.pan_and_scan``'s, for many sizes."""
    ip = hf_processor("gemma3", "pil").image_processor
    rng = random.Random(f"{SEED}-crops")
    for height, width in _sizes(rng, 200):
        # each pixel holds its own coordinates: a crop's values name its box
        rows = np.broadcast_to(np.arange(height)[:, None], (height, width))
        cols = np.broadcast_to(np.arange(width)[None, :], (height, width))
        chw = np.stack([rows, cols])
        theirs = ip.pan_and_scan(
            image=chw,
            pan_and_scan_min_crop_size=params.pan_and_scan_min_crop_size,
            pan_and_scan_max_num_crops=params.pan_and_scan_max_num_crops,
            pan_and_scan_min_ratio_to_activate=params.pan_and_scan_min_ratio_to_activate,
        )
        ours = pan_and_scan_crops(height, width, params)
        where = f"[seed {SEED}] {height}x{width} {params}"
        assert len(ours) == len(theirs), where
        for (top, left, h, w), crop in zip(ours, theirs, strict=True):
            assert crop.shape[1:] == (h, w), where
            assert crop[0, 0, 0] == top and crop[1, 0, 0] == left, where
    assert pan_and_scan_crops(300, 1000, _params(do_pan_and_scan=False)) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_pan_and_scan": True},
        {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64},
        {
            "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": 40,
            "pan_and_scan_max_num_crops": 6,
            "pan_and_scan_min_ratio_to_activate": 1.5,
        },
    ],
)
def test_transform_with_crops_is_the_hf_processors(backend: str, kwargs: dict[str, Any]) -> None:
    """uint8 crops bit for bit, the classic path's floats exactly, crop counts as HF counts
    them, and the prompt as vLLM makes it of HF's (its newline merges)."""
    proc = hf_processor("gemma3", backend)
    rng = random.Random(f"{SEED}-{backend}-{sorted(kwargs.items())}")
    nrng = np.random.default_rng(rng.randrange(2**32))
    sizes = [(300, 1000), (1200, 300), (640, 480), (rng.randint(50, 900), rng.randint(50, 900))]
    images = [photo_like(nrng, h, w) for h, w in sizes]
    # words between the images: a range keeps its length before the merges inside it (one
    # per crop after the first), so it reaches that far past its own tokens (as vLLM's)
    gap = "and look at the second"
    text = f"user describe {BOI} {gap} {BOI} {gap} {BOI} {gap} {BOI} please"
    ids = proc.tokenizer(text)["input_ids"]
    u8 = proc(text=[text], images=images, return_tensors="pt", do_rescale=False,
              do_normalize=False, **kwargs)  # fmt: skip
    floats = proc(text=[text], images=images, return_tensors="pt", **kwargs)["pixel_values"]
    # the image processor alone: with the processor's defaults, as the processor calls it
    crops = proc.image_processor(
        images=images, return_tensors="pt", **{**PROCESSOR_DEFAULTS, **kwargs}
    )["num_crops"]
    where = f"[seed {SEED}] {backend} {sizes} {kwargs}"
    for mode, normalize in itertools.product(("hf", "native"), (True, False)):
        config = MultiModalConfig(transform=mode, mm_device_do_normalize=normalize)
        out = build_processor("gemma3", proc, config=config).apply(ids, {"image": images}, kwargs)
        merged = out.merged_kwargs()
        assert merged["num_patches"].tolist() == [int(c) + 1 for c in crops], where
        want = u8["pixel_values"].to(torch.uint8) if normalize else floats
        assert merged["pixel_values"].dtype == want.dtype, where
        assert torch.equal(merged["pixel_values"], want), f"{where} {mode} pixel_values"
        tokens = merge_newlines(u8["input_ids"][0].tolist(), _newlines(proc))
        assert out.prompt_token_ids == tokens, f"{where} {mode} token ids"


def _newlines(proc: Any) -> list[int]:
    return [int(proc.tokenizer.convert_tokens_to_ids("\n" * n)) for n in range(1, 5)]


def test_merge_newlines_is_vllms_order_of_passes() -> None:
    """``\\n`` + ``\\n\\n`` first, then ``\\n\\n`` + ``\\n``, then ``\\n\\n`` + ``\\n\\n``, each
    left to right without overlaps (vLLM's three ``replace_token_matches`` calls)."""
    n1, n2, n3, n4, x = 1, 2, 3, 4, 9
    nl = (n1, n2, n3, n4)
    assert merge_newlines([x, n1, n2, x], nl) == [x, n3, x]
    assert merge_newlines([n2, n1, n2], nl) == [n2, n3]  # the first pass wins
    assert merge_newlines([n2, n2, n2], nl) == [n4, n2]
    assert merge_newlines([n2, n1, n2, n2], nl) == [n2, n3, n2]  # a merge never merges again
    assert merge_newlines([n1, n1, n3, x], nl) == [n1, n1, n3, x]


def test_adjacent_images_are_refused_as_vllm_refuses_them() -> None:
    """Two images with nothing between them share a merged ``\\n\\n\\n\\n`` token: their
    ranges would overlap (vLLM's render server answers 400, ``fixtures_gemma3``)."""
    proc = hf_processor("gemma3", "torchvision")
    images = [photo_like(np.random.default_rng(0), 30, 40)] * 2
    processor = build_processor("gemma3", proc)
    apart = proc.tokenizer(f"user {BOI} and {BOI}")["input_ids"]
    out = processor.apply(apart, {"image": images})
    (first, second) = out.mm_placeholders["image"]
    assert first.offset + first.length <= second.offset
    adjacent = proc.tokenizer(f"user {BOI}{BOI}")["input_ids"]
    with pytest.raises(ItemRejectedError, match="overlaps the previous image"):
        processor.apply(adjacent, {"image": images})


def test_processor_kwargs_the_transform_does_not_read_are_refused() -> None:
    processor = build_processor("gemma3")
    image = [photo_like(np.random.default_rng(1), 30, 40)]
    ids = processor.hf_processor.tokenizer(f"user {BOI}")["input_ids"]
    for bad in ({"do_resize": False}, {"size": {"shortest_edge": 224}}, {"max_pixels": 1}):
        with pytest.raises(ProcessorKwargsError):
            processor.apply(ids, {"image": image}, bad)
    with pytest.raises(ProcessorKwargsError, match="at least 1"):
        processor.apply(ids, {"image": image}, {"do_pan_and_scan": True,
                                                "pan_and_scan_min_crop_size": 0})  # fmt: skip


def _decoded(url: str) -> PIL.Image.Image:
    data = base64.b64decode(url.split(",", 1)[1])
    return PIL.Image.open(io.BytesIO(data)).convert("RGB")


@pytest.mark.parametrize("name", RECORDED_CASES)
def test_pan_and_scan_renders_as_vllm(name: str) -> None:
    """Token ids, ranges and items (bytes, via their digests) of a request with pan-and-scan
    kwargs equal vLLM's render server's (started with ``--trust-request-mm-kwargs``)."""
    case = json.loads((RECORDED / f"{name}.json").read_text())
    body, response = case["body"], case["response"]
    config = MultiModalConfig(mm_device_do_normalize=False)  # vLLM's Gemma 3: bfloat16 pixels
    processor = build_processor("gemma3", config=config)
    tokenizer = processor.hf_processor.tokenizer
    conversation, images = [], []
    for message in body["messages"]:
        content = message["content"]
        if not isinstance(content, str):
            for part in content:
                if part["type"] == "image_url":
                    images.append(_decoded(part["image_url"]["url"]))
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        conversation.append({"role": message["role"], "content": content})
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=CHAT_TEMPLATES["Gemma3Processor"],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    kwargs = body["mm_processor_kwargs"]
    if case["status"] != 200:
        assert response["error"]["code"] == 400
        with pytest.raises(ItemRejectedError):
            processor.apply(ids, {"image": images}, kwargs)
        return
    out = processor.apply(ids, {"image": images}, kwargs)
    assert out.prompt_token_ids == response["token_ids"], name
    ranges = [{"offset": r.offset, "length": r.length} for r in out.mm_placeholders["image"]]
    assert ranges == response["features"]["mm_placeholders"]["image"], name
    kwargs_data = response["features"]["kwargs_data"]
    if kwargs_data is None:  # mm_payload "none"
        return
    items, metadata = encode_items(
        out.mm_kwargs["image"], WireForm.of(processor), float_dtype=torch.bfloat16
    )
    for i, (item, digest) in enumerate(zip(items, kwargs_data["image"], strict=True)):
        sent = str(item)
        assert len(sent) == digest["chars"], f"{name}: item {i} length"
        assert hashlib.sha256(sent.encode()).hexdigest() == digest["sha256"], f"{name}: item {i}"
    assert [str(m) for m in metadata] == response["features"]["mm_metadata"]["image"], name


@pytest.mark.anyio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_routing_plans_with_crops_equal_the_render(backend: str) -> None:
    """``Engine.plan`` (image headers only) gives the full render's ids and ranges with
    pan-and-scan kwargs, and the same refusal for adjacent images."""

    def png(height: int, width: int, seed: int) -> bytes:
        buf = io.BytesIO()
        photo_like(np.random.default_rng(seed), height, width).save(buf, "PNG")
        return buf.getvalue()

    processor = build_processor("gemma3", backend=backend)
    config = EngineConfig(device="cpu", transform_threads=2, cache_capacity_bytes=0)
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 48}
    images = [png(90, 400, 1), png(500, 120, 2), png(64, 64, 3)]
    gap = "and look at the second image in detail"
    apart = Request(prompt=f"{BOI} {gap} {BOI} {gap} {BOI} please", images=images,
                    mm_processor_kwargs=kwargs)  # fmt: skip
    adjacent = Request(prompt=f"look {BOI}{BOI} please", images=images[:2],
                       mm_processor_kwargs=kwargs)  # fmt: skip
    async with Engine(processor, config) as engine:
        full = await engine.process(apart, device=False)
        plan = await engine.plan(apart)
        assert plan.prompt_token_ids == full.prompt_token_ids
        assert plan.mm_placeholders == full.mm_placeholders
        lengths = [r.length for r in full.mm_placeholders["image"]]
        assert lengths[0] > 260 and lengths[1] > 260 and lengths[2] == 260, lengths
        for call in (engine.plan, lambda r: engine.process(r, device=False)):
            with pytest.raises(AiommError) as refused:
                await call(adjacent)
            assert isinstance(refused.value, ItemRejectedError), refused.value
