"""``aiomm serve gemma4`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_gemma4/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("gemma4", ...)`` writes: token ids, placeholder
ranges from ``<|image>`` to ``<image|>``, ``pixel_values`` (each image's 16-px patches, rescaled
on the host and padded with zero patches to 280 x 9 rows) and ``pixel_position_ids``. Nothing is
kept on the CPU, so no item has ``mm_metadata``. A bad image is refused, alone or beside a good
one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

FIXTURES = Path(__file__).parent / "fixtures_gemma4"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: undecodable images
REFUSED = {"error_bad_image", "error_one_of_two_images_bad"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_the_fixtures_cover_successes_refusals_and_sizes() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    assert len(statuses) - len(REFUSED) >= 12
    lengths = set()
    for name in CASES:
        features = _load(name)["response"].get("features") or {}
        for r in (features.get("mm_placeholders") or {}).get("image", []):
            lengths.add(r["length"])
    # several aspect ratios: the soft-token counts (plus <|image> and <image|>) differ
    assert len(lengths) >= 3, lengths
    assert all(r - 2 <= 280 for r in lengths)


@pytest.mark.parametrize("name", CASES)
def test_gemma4_images_match_vllm(live_server_gemma4: Any, name: str) -> None:
    case = _load(name)
    assert_matches_recorded(live_server_gemma4.url, case, name, timeout=120)
    if case["status"] != 200:
        return
    features = case["response"]["features"]
    assert features["mm_metadata"] is None
    for r in features["mm_placeholders"].get("image", []):
        # some image size gives this count (280 soft tokens at most, 1 at least)
        assert 1 <= r["length"] - 2 <= 280, (name, r)
