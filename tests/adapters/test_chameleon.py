"""Chameleon cases beyond the parity harness: CPU normalisation by default, and processor kwargs
whose crop exceeds the resized image (each backend pads it differently)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case, prompt_text
from parity import SEED, hf_processor

from aiomm.adapters import build_processor, get_adapter_info
from aiomm.media.samples import photo_like

NAME = "chameleon"


def test_cpu_normalise_by_default() -> None:
    """mm_device_do_normalize is off by default: HF's float output, with the chat sep token."""
    assert get_adapter_info(NAME).mm_device_do_normalize is False
    proc = hf_processor(NAME, "pil")
    text = prompt_text(NAME, 1)
    image = photo_like(np.random.default_rng(SEED), 97, 211)
    ref = proc(text=[text], images=[image], return_tensors="pt")
    ours = build_processor(NAME, proc)
    assert ours.device_normalize is False
    out = ours.apply(proc.tokenizer(text)["input_ids"], {"image": [image]})
    sep = proc.tokenizer.convert_tokens_to_ids(proc.tokenizer.sep_token)
    assert out.normalization is None and out.prompt_token_ids[-1] == sep
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(out.merged_kwargs()["pixel_values"], ref["pixel_values"]), f"seed={SEED}"


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": {"shortest_edge": 63}, "crop_size": {"height": 70, "width": 95}},
        {"size": {"height": 40, "width": 61}, "crop_size": {"height": 31, "width": 30}},
    ],
)
def test_processor_kwargs(backend: str, kwargs: dict[str, Any]) -> None:
    check_case(NAME, backend, 1, SEED, sizes=[(77, 101)], kwargs=kwargs)
