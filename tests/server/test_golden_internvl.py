"""aiomm serve internvl against vLLM 0.33's render server for the same offline folder.

The fixtures in ``fixtures_internvl/`` were recorded from ``vllm launch render`` serving
``aiomm.adapters.folders.write_model_folder("internvl")`` (see ``record_fixtures.py``), their
items kept as digests (13 tiles of 448 x 448 in bfloat16 are 20 MB of base64 per image). aiomm
must give the same token ids, placeholders, mm_hashes and items, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_internvl"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: vLLM's InternVL item: the image token's id (shared), the tile count and the tiles
ITEM_KEYS = ["image_token_id", "image_num_patches", "pixel_values"]


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_internvl_matches_vllm(live_server_internvl: Any, name: str) -> None:
    case = _load(name)
    resp = assert_matches_recorded(live_server_internvl.url, case, name, timeout=120)
    features = resp.json().get("features") if resp.status_code == 200 else None
    if not features or features["kwargs_data"] is None:
        return
    # the digests cover the items' bytes; the fields are checked in the clear on ours
    ids = resp.json()["token_ids"]
    for item, placeholder in zip(
        features["kwargs_data"]["image"], features["mm_placeholders"]["image"], strict=True
    ):
        decoded = decode_item(item)
        assert list(decoded) == ITEM_KEYS
        tiles = int.from_bytes(decoded["image_num_patches"][0].data, "little")
        assert decoded["pixel_values"][0].shape == (tiles, 3, 448, 448)
        # <img> + 256 <IMG_CONTEXT> per tile + </img>
        assert placeholder["length"] == 256 * tiles + 2
        span = ids[placeholder["offset"] : placeholder["offset"] + placeholder["length"]]
        assert len(set(span[1:-1])) == 1 and span[0] != span[-1]


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
        "chat_thin_image",  # 600 x 2: the widest grid (12 x 1) and a thumbnail
        "chat_phone_photo_48mp",
        "chat_mm_none",
        "error_bad_image",
        "error_one_of_two_images_bad",
        "error_truncate_splits_image",
    }
    assert wanted <= set(CASES)
    assert sum(p.stat().st_size for p in FIXTURES.glob("*.json")) < 2 << 20
