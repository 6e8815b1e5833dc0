"""``aiomm serve gemma3`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_gemma3/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("gemma3", ...)`` writes: token ids with vLLM's newline
merges, placeholder ranges found as vLLM finds them, ``pixel_values`` (one 896 x 896 image per
item) and ``num_patches`` (kept on the CPU, so also in ``mm_metadata``); two images with nothing
between them are refused (``chat_two_images``, ``chat_mm_none``: their ranges overlap).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_gemma3"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: adjacent images
REFUSED = {"chat_two_images", "chat_mm_none"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_the_fixtures_cover_successes_and_refusals() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    assert len(statuses) - len(REFUSED) >= 8


@pytest.mark.parametrize("name", CASES)
def test_gemma3_images_match_vllm(live_server_gemma3: Any, name: str) -> None:
    case = _load(name)
    assert_matches_recorded(live_server_gemma3.url, case, name, timeout=120)
    if case["status"] != 200:
        return
    features = case["response"]["features"]
    assert all(r["length"] == 260 for r in features["mm_placeholders"]["image"])
    metadata = features["mm_metadata"]
    if metadata is None:  # mm_payload "none"
        return
    assert all(set(decode_item(m)) == {"num_patches"} for m in metadata["image"])
