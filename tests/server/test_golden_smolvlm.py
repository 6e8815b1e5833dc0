"""``aiomm serve smolvlm`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_smolvlm/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("smolvlm", ...)`` writes: token ids, placeholder
ranges from the first ``<fake_token_around_image>`` to the last, ``pixel_values`` (every 384-px
sub-image and the global image, normalised on the host as for Idefics3), ``pixel_attention_mask``
and the image's ``num_patches`` (kept on the CPU, so also in ``mm_metadata``). Every image's
longest edge is resized to 1536 px first, so even small images are split into a grid; a bad
image is refused, alone or beside a good one, and so is a video (SmolVLM takes images only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_smolvlm"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: undecodable images, and a video
REFUSED = {"error_bad_image", "error_one_of_two_images_bad", "video_short"}
#: ``<image>`` tokens per sub-image (384 px, patch 14, pixel shuffle 3)
PER_IMAGE = 81


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _range_length(num_patches: int) -> int:
    """Tokens of one image's expansion with the offline word-level tokenizer (its newlines
    vanish): per sub-image and for the global image ``<fake_token_around_image>``, a position
    tag and the ``<image>`` run, then the closing ``<fake_token_around_image>``."""
    return num_patches * (2 + PER_IMAGE) + 1


def test_the_fixtures_cover_successes_refusals_and_grids() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    assert _load("video_short")["response"]["error"]["param"] == "video"
    assert len(statuses) - len(REFUSED) >= 12
    counts = set()
    for name in CASES:
        metadata = (_load(name)["response"].get("features") or {}).get("mm_metadata")
        for item in (metadata or {}).get("image", []):
            counts.add(int(decode_item(item)["num_patches"][0].array().reshape(-1)[0]))
    # 4 x 4 (square), 3 x 4 and 4 x 3, 2 x 4 and 4 x 2 sub-images, each with the global one
    assert {17, 13, 9} <= counts


@pytest.mark.parametrize("name", CASES)
def test_smolvlm_images_match_vllm(live_server_smolvlm: Any, name: str) -> None:
    case = _load(name)
    assert_matches_recorded(live_server_smolvlm.url, case, name, timeout=120)
    if case["status"] != 200:
        return
    features = case["response"]["features"]
    metadata = features["mm_metadata"]
    if metadata is None:  # mm_payload "none"
        return
    ranges = features["mm_placeholders"]["image"]
    for item, r in zip(metadata["image"], ranges, strict=True):
        fields = decode_item(item)
        assert list(fields) == ["num_patches"]
        (patches,) = fields["num_patches"][0].array().reshape(-1).tolist()
        assert r["length"] == _range_length(patches), (name, r, patches)
