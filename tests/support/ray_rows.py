"""Rows, engine references and comparisons shared by the Ray tests."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import numpy as np
import ray
import torch

from aiomm import adapters
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request, Result

PH = "<|vision_start|><|image_pad|><|vision_end|>"


@contextlib.contextmanager
def ray_started_away_from_the_checkout(
    start: Callable[[], Any], stop: Callable[[], Any] = ray.shutdown
) -> Iterator[Any]:
    """``start()`` (``ray.init`` or a cluster) run from an empty directory, kept until the block
    ends: the driver's working directory goes on every worker's ``sys.path`` (where the
    checkout's top-level ``kernels/`` would shadow the Hugging Face ``kernels`` package), and
    Ray's processes keep it as theirs (it must outlive them)."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as empty:
        os.chdir(empty)
        try:
            started = start()
        finally:
            os.chdir(here)
        try:
            yield started
        finally:
            stop()


def prompt(n: int) -> str:
    return " ".join(["<|im_start|>user describe", *[PH] * n, "<|im_end|>"])


def token_ids(text: str) -> list[int]:
    tokenizer = adapters.build_processor("qwen2-vl").hf_processor.tokenizer
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def png(seed: int, h: int = 48, w: int = 64) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), h, w), "PNG")


def engine_results(
    config: EngineConfig, requests: Sequence[Request], *, device: bool, model: str = "qwen2-vl"
) -> list[Result]:
    """What ``Engine.process`` (through ``process_safe``) of ``model`` gives for ``requests``, in
    order."""

    async def main() -> list[Result]:
        async with Engine.from_pretrained(model, config) as engine:
            return [await engine.process_safe(r, device=device) for r in requests]

    return anyio.run(main)


def assert_row_equals(row: Mapping[str, Any], result: Result) -> None:
    """One output row of ImagePreprocessor equals ``result`` bit for bit (or carries its error)."""
    if not result.ok:
        # the same typed error and message; request ids are fresh per run
        want = f"{type(result.error).__name__}: {result.error}"
        assert row["error"].split(" [request_id=")[0] == want.split(" [request_id=")[0]
        assert len(row["prompt_token_ids"]) == 0
        # the model input column (pixels, or an audio adapter's features) is empty
        assert row["pixel_values" if "pixel_values" in row else "input_features"].size == 0
        return
    assert row["error"] is None
    assert list(row["prompt_token_ids"]) == result.prompt_token_ids
    # one modality per row: images, or an audio adapter's clips
    ranges = [(p.offset, p.length) for found in result.mm_placeholders.values() for p in found]
    assert row["mm_placeholders"].tolist() == [list(r) for r in ranges]
    assert list(row["mm_hashes"]) == result.item_hashes
    for key, value in result.mm_kwargs.items():
        expected = value.float() if value.dtype == torch.bfloat16 else value
        got = row[key]
        assert got.dtype == expected.numpy().dtype, key
        assert np.array_equal(got, expected.numpy()), key
