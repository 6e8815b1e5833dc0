"""aiomm serve paddleocr-vl against vLLM 0.33's render server for the same offline folder.

The fixtures in ``fixtures_paddleocr_vl/`` were recorded from ``vllm launch render`` serving
``aiomm.adapters.folders.write_model_folder("paddleocr-vl")`` (see ``record_fixtures.py``), the
items of the image cases kept as digests (an image of up to 2.8 megapixels is up to 14400
normalised 3 x 14 x 14 patches in bfloat16). aiomm must give the same token ids, placeholders,
mm_hashes and items, byte for byte.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_paddleocr_vl"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: vLLM's PaddleOCR-VL item: the image's patches and its grid
ITEM_KEYS = {"pixel_values", "image_grid_thw"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_paddleocr_vl_matches_vllm(live_server_paddleocr_vl: Any, name: str) -> None:
    case = _load(name)
    resp = assert_matches_recorded(live_server_paddleocr_vl.url, case, name, timeout=120)
    features = resp.json().get("features") if resp.status_code == 200 else None
    if not features or features["kwargs_data"] is None:
        return
    # the digests cover the items' bytes; the fields are checked in the clear on ours
    ids = resp.json()["token_ids"]
    for item, placeholder in zip(
        features["kwargs_data"]["image"], features["mm_placeholders"]["image"], strict=True
    ):
        decoded = decode_item(item)
        assert set(decoded) == ITEM_KEYS
        grid = decoded["image_grid_thw"][0]
        thw = torch.frombuffer(bytearray(grid.data), dtype=torch.int64).tolist()
        assert thw[0] == 1
        assert decoded["pixel_values"][0].shape == (math.prod(thw), 3, 14, 14)
        # one <|IMAGE_PLACEHOLDER|> per 2 x 2 patches, between <|IMAGE_START|> and <|IMAGE_END|>
        assert placeholder["length"] == math.prod(thw) // 4
        start, end = placeholder["offset"], placeholder["offset"] + placeholder["length"]
        assert len(set(ids[start:end])) == 1
        assert ids[start - 1] != ids[start] != ids[end]


def test_fixtures_cover_the_acceptance_cases() -> None:
    wanted = {
        "chat_jpeg",
        "chat_two_images",
        "chat_rgba",
        "chat_greyscale",
        "chat_palette",
        "chat_exif_rotated",
        "chat_multi_turn",
        "chat_system",
        "chat_image_first",
        "chat_tiled_images",
        "chat_phone_photo_48mp",  # above the pixel bound: scaled down
        "chat_mm_none",
        "error_bad_image",
        "error_one_of_two_images_bad",
        "error_image_aspect_ratio",  # 600 x 2: refused, as Qwen-VL refuses it
    }
    assert wanted <= set(CASES)
    refused = _load("error_image_aspect_ratio")
    assert refused["status"] == 400
