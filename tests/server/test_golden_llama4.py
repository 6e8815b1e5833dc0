"""``aiomm serve llama4`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_llama4/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("llama4", ...)`` writes: token ids, placeholder ranges
from ``<|image_start|>`` to ``<|image_end|>``, ``pixel_values`` (every 336-px tile of the image,
bfloat16, normalised on the host: vLLM does not defer Llama 4's normalisation), and the image's
``patches_per_image`` and ``aspect_ratios`` (kept on the CPU, so also in ``mm_metadata``). Small
images are one tile; ``chat_tiled_images`` and the 48-megapixel photo are cut into grids (up to
16 tiles) plus a global tile. A bad image is refused, alone or beside a good one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_llama4"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: undecodable images
REFUSED = {"error_bad_image", "error_one_of_two_images_bad"}
#: ``<|patch|>`` tokens per tile (336-px tiles, patch 14, pixel shuffle 0.5)
PER_TILE = 144


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _range_length(rows: int, cols: int) -> int:
    """Tokens of one image's expansion: the tiles' rows (with separators) when there are
    several, then ``<|image|>`` and the global tile, between the start and end tokens."""
    tiles = 0 if rows * cols == 1 else rows * (cols * PER_TILE + (cols - 1) + 1)
    return 1 + tiles + 1 + PER_TILE + 1


def test_the_fixtures_cover_successes_refusals_and_tiles() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    assert len(statuses) - len(REFUSED) >= 12
    grids = set()
    for name in CASES:
        metadata = (_load(name)["response"].get("features") or {}).get("mm_metadata")
        for item in (metadata or {}).get("image", []):
            grids.add(tuple(decode_item(item)["aspect_ratios"][0].array().tolist()))
    assert {(1, 1), (2, 3), (3, 1), (3, 4)} <= grids


@pytest.mark.parametrize("name", CASES)
def test_llama4_images_match_vllm(live_server_llama4: Any, name: str) -> None:
    case = _load(name)
    assert_matches_recorded(live_server_llama4.url, case, name, timeout=120)
    if case["status"] != 200:
        return
    features = case["response"]["features"]
    metadata = features["mm_metadata"]
    if metadata is None:  # mm_payload "none"
        return
    ranges = features["mm_placeholders"]["image"]
    for item, r in zip(metadata["image"], ranges, strict=True):
        fields = decode_item(item)
        assert list(fields) == ["patches_per_image", "aspect_ratios"]
        rows, cols = fields["aspect_ratios"][0].array().tolist()
        (tiles,) = fields["patches_per_image"][0].array().reshape(-1).tolist()
        assert tiles == (1 if rows * cols == 1 else 1 + rows * cols)
        assert r["length"] == _range_length(rows, cols), (name, r, rows, cols)
