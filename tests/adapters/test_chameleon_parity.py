"""Parity of the Chameleon adapter with ``ChameleonProcessor``.

Every run draws fresh random images (the seed is printed on failure) of many sizes and aspect
ratios, one per prompt. For both HF backends and both of our transforms: token ids equal HF's
``input_ids`` (the chat-mode sep token appended), the placeholder range covers
``<racm3:break> <image>*1024 <eoss>`` with ``is_embed`` on the ``<image>`` tokens only, uint8
``pixel_values`` equal HF's output with rescale/normalise disabled bit for bit (when
``mm_device_do_normalize`` is turned on) and after ``FusedMMInputNorm`` they equal HF's default
float output to a norm-wise relative error under 1e-6. With the default (normalising on the CPU)
both transforms return HF's float output exactly.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import parity
import pytest
import torch
from parity import SEED, rel_err

from aiomm.adapters import build_processor, supported_adapters
from aiomm.errors import ItemCountMismatchError
from aiomm.processing.processor import MultiModalConfig
from aiomm.samples import photo_like

BACKENDS = ("torchvision", "pil")
NAME = "chameleon"


# Every image is resized to a 512 shortest edge (Lanczos) before the crop, so thin images become
# very large: keep the aspect ratios moderate.
SIZES = [(1, 1), (3, 5), (28, 28), (57, 33), (240, 320), (333, 500), (480, 640), (512, 512),
         (513, 700), (700, 200), (90, 300), (1080, 1920)]  # fmt: skip


def hf_processor(backend: str) -> Any:
    return parity.hf_processor(NAME, backend)


def draw_size(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 0.5:
        return rng.choice(SIZES)
    h = rng.randint(1, 900)
    return h, max(1, min(rng.randint(1, 900), 4 * h, 900))


PROMPT = "user describe the image <image> what is in this picture assistant"


def check_case(backend: str, case_seed: int, size: tuple[int, int] | None = None) -> None:
    rng = random.Random(case_seed)
    h, w = size or draw_size(rng)
    image = photo_like(np.random.default_rng(case_seed), h, w)
    ctx = f"[{NAME}/{backend} seed={case_seed} size={(h, w)}]"

    proc = hf_processor(backend)
    ref_u8 = proc(text=[PROMPT], images=[image], return_tensors="pt", do_rescale=False,
                  do_normalize=False)  # fmt: skip
    ref_f = proc(text=[PROMPT], images=[image], return_tensors="pt")
    prompt_ids = proc.tokenizer(PROMPT)["input_ids"]
    expected_ids = ref_u8["input_ids"][0].tolist()
    sep = proc.tokenizer.convert_tokens_to_ids(proc.tokenizer.sep_token)
    assert expected_ids[-1] == sep and prompt_ids[-1] != sep, ctx

    outputs = {}
    for mode in ("hf", "native"):
        config = MultiModalConfig(mm_device_do_normalize=True, transform=mode)
        out = build_processor(NAME, proc, config=config).apply(prompt_ids, {"image": [image]})
        assert out.prompt_token_ids == expected_ids, f"{ctx} {mode}: token ids differ"
        (r,) = out.mm_placeholders["image"]
        tokens = expected_ids[r.offset : r.offset + r.length]
        assert tokens == [proc.image_start_token_id, *[proc.image_token_id] * 1024,
                          proc.image_end_token_id], ctx  # fmt: skip
        assert r.is_embed == (False, *[True] * 1024, False), f"{ctx} {mode}: is_embed"

        pv = out.merged_kwargs()["pixel_values"]
        assert pv.dtype == torch.uint8, f"{ctx} {mode}: {pv.dtype}"
        ref_pv = ref_u8["pixel_values"]
        assert pv.shape == ref_pv.shape == (1, 3, 512, 512), f"{ctx} {mode}: {pv.shape}"
        assert torch.equal(pv.double(), ref_pv.double()), f"{ctx} {mode}: uint8 differs from HF"

        norm = out.normalization
        assert norm is not None and norm.layout.name == "NCHW", ctx
        normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
        err = rel_err(normalised, ref_f["pixel_values"])
        assert err < 1e-6, f"{ctx} {mode}: normalised rel err {err:.3g}"
        outputs[mode] = pv
    assert torch.equal(outputs["hf"], outputs["native"]), f"{ctx}: native != hf"


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity(backend: str) -> None:
    rng = random.Random(f"{SEED}-{backend}")
    for _ in range(6):
        check_case(backend, rng.randrange(2**31))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_large_photo(backend: str) -> None:
    check_case(backend, random.Random(f"{SEED}-large-{backend}").randrange(2**31), (1536, 2048))


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_cpu_normalise_native_equals_hf_float(backend: str) -> None:
    """mm_device_do_normalize is off by default: both transforms return HF's float output."""
    nrng = np.random.default_rng(SEED)
    proc = hf_processor(backend)
    prompt_ids = proc.tokenizer(PROMPT)["input_ids"]
    for size in ((97, 211), (640, 480)):
        image = photo_like(nrng, *size)
        ref = proc(text=[PROMPT], images=[image], return_tensors="pt")
        for mode in ("hf", "native"):
            ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
            assert ours.device_normalize is False
            out = ours.apply(prompt_ids, {"image": [image]})
            assert out.normalization is None
            assert out.prompt_token_ids == ref["input_ids"][0].tolist()
            pv = out.merged_kwargs()["pixel_values"]
            assert pv.dtype == torch.float32
            assert torch.equal(pv, ref["pixel_values"]), f"{backend}/{mode} {size} seed={SEED}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_processor_kwargs(backend: str) -> None:
    """A crop larger than the resized image (each backend pads differently) and a fixed size."""
    nrng = np.random.default_rng(SEED)
    image = photo_like(nrng, 77, 101)
    proc = hf_processor(backend)
    prompt_ids = proc.tokenizer(PROMPT)["input_ids"]
    for kwargs in (
        {"size": {"shortest_edge": 63}, "crop_size": {"height": 70, "width": 95}},
        {"size": {"height": 40, "width": 61}, "crop_size": {"height": 31, "width": 30}},
    ):
        ref = proc(text=[PROMPT], images=[image], return_tensors="pt", do_rescale=False,
                   do_normalize=False, **kwargs)  # fmt: skip
        for mode in ("hf", "native"):
            config = MultiModalConfig(mm_device_do_normalize=True, transform=mode)
            out = build_processor(NAME, proc, config=config).apply(
                prompt_ids, {"image": [image]}, kwargs
            )
            pv = out.merged_kwargs()["pixel_values"]
            assert torch.equal(pv, ref["pixel_values"]), f"{backend} {kwargs} {mode} seed={SEED}"


def test_registry_and_errors() -> None:
    info = {i.short_name: i for i in supported_adapters()}[NAME]
    assert info.architecture == "ChameleonForConditionalGeneration"
    assert info.mm_device_do_normalize is False
    proc = hf_processor("pil")
    image = photo_like(np.random.default_rng(SEED), 30, 40)
    with pytest.raises(ItemCountMismatchError):
        build_processor(NAME, proc).apply(proc.tokenizer("describe")["input_ids"],
                                          {"image": [image]})  # fmt: skip
