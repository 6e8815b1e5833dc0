"""Ray rows -> vLLM ``GenerateRequest``s: an ``ImagePreprocessor`` made with ``vllm_model_id``
gives, for the prompt and images a golden fixture recorded from vLLM's render server, the same
token ids and features (mm_hashes, placeholders, every item byte for byte), and
:func:`generate_request` a body the strict ``/inference/v1/generate`` validator accepts."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("starlette")
from aiomm.config import EngineConfig
from aiomm.errors import ConfigError, InvalidRequestError
from aiomm.integrations.ray import ImagePreprocessor, generate_request

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL
from render_compare import feature_differences
from test_golden import _load
from upstream_standin import validate

IMAGE_PAD = 151655


def _images(body: dict[str, Any]) -> list[bytes]:
    out = []
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part.get("type") == "image_url":
                out.append(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
    return out


def _collapsed(token_ids: list[int]) -> list[int]:
    """The prompt before expansion: each run of image pads back to one pad."""
    out: list[int] = []
    for t in token_ids:
        if not (t == IMAGE_PAD and out and out[-1] == IMAGE_PAD):
            out.append(t)
    return out


def _column(values: list[Any]) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def test_rows_become_vllm_generate_requests(model_folder: Path) -> None:
    cases = [_load(name) for name in ("chat_jpeg", "chat_two_images")]
    pre = ImagePreprocessor(
        str(model_folder),
        config=EngineConfig(device="cpu", transform_threads=1),
        vllm_model_id=RECORDED_MODEL,
    )
    batch = {
        "image": _column([_images(c["body"]) for c in cases] + [[np.zeros((32, 32, 3), np.uint8)]]),
        "prompt_token_ids": _column(
            [_collapsed(c["response"]["token_ids"]) for c in cases] + [[1, IMAGE_PAD, 2]]
        ),
    }

    async def run() -> Any:
        try:
            return await pre(batch)
        finally:
            await pre.aclose()

    rows = anyio.run(run).to_pylist()
    for case, row in zip(cases, rows, strict=False):
        want = case["response"]
        assert row["error"] is None, row["error"]
        assert row["prompt_token_ids"] == want["token_ids"]
        features = json.loads(row["features"])
        found = feature_differences(features, want["features"])
        assert not found, found
        body = generate_request(row, model=want["model"], sampling_params=want["sampling_params"])
        assert validate(body) == [], validate(body)
        assert body["features"] == features and body["token_ids"] == want["token_ids"]
    bad = rows[-1]
    assert bad["features"] is None and "encoded image bytes" in bad["error"]
    with pytest.raises(InvalidRequestError, match="the row failed"):
        generate_request(bad, model="m")


def test_vllm_features_exclude_normalised_rows() -> None:
    with pytest.raises(ConfigError, match="normalize"):
        ImagePreprocessor("qwen2-vl", vllm_model_id="/m", normalize=True)


def test_vllm_features_refuse_a_model_with_its_own_item_modality() -> None:
    with pytest.raises(ConfigError, match="vision_chunk"):
        ImagePreprocessor("kimi-k2.5", vllm_model_id="/m")
