"""``aiomm serve deepseek-ocr-2`` and ``deepseek-ocr`` against responses recorded from vLLM
0.33's own render server.

The fixtures (``fixtures_deepseek_ocr2/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("deepseek-ocr-2", ...)`` writes: token ids (the
template's BOS, then each ``<image>`` repeated to 256 + 1 tokens, plus 144 per local view of a
tiled image), placeholder ranges over the ``<image>`` runs, and each item's ``images_crop``
(768-px local views), ``pixel_values`` (the 1024-px padded global view) and
``images_spatial_crop`` (kept on the CPU, so also in ``mm_metadata``), all pixels normalised on
the host and sent as bfloat16. A bad image is refused, alone or beside a good one. The
``crop_modes/`` cases (per-request processor kwargs, recorded from a server started with
``--trust-request-mm-kwargs``) are replayed by ``tests/adapters/test_deepseek_ocr.py``.

``fixtures_deepseek_ocr/`` holds the same cases for DeepSeek-OCR (``write_model_folder(
"deepseek-ocr", ...)``): 640-px local views and strategy v1's counts, 16 x 17 + 1 tokens per
image plus (10 rows) x (10 cols + 1) for a tiled one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_deepseek_ocr2"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
FIXTURES_V1 = Path(__file__).parent / "fixtures_deepseek_ocr"
CASES_V1 = sorted(p.stem for p in FIXTURES_V1.glob("*.json"))
#: the cases vLLM refuses: undecodable images
REFUSED = {"error_bad_image", "error_one_of_two_images_bad"}


def _load(name: str, folder: Path = FIXTURES) -> dict[str, Any]:
    return json.loads((folder / f"{name}.json").read_text())


def _range_length(cols: int, rows: int) -> int:
    """vLLM's tokens of one image: 16 x 16 global queries, a separator, 12 x 12 per local view."""
    return 256 + 1 + (144 * cols * rows if cols * rows > 1 else 0)


def _range_length_v1(cols: int, rows: int) -> int:
    """DeepSeek-OCR's (strategy v1): every row of queries ends with a newline query."""
    return 16 * 17 + 1 + (10 * rows * (10 * cols + 1) if cols * rows > 1 else 0)


@pytest.mark.parametrize(
    ("folder", "tiled"),
    [(FIXTURES, {(1, 1), (1, 3)}), (FIXTURES_V1, {(1, 1), (1, 3), (2, 1)})],
    ids=["deepseek-ocr-2", "deepseek-ocr"],
)
def test_the_fixtures_cover_successes_refusals_and_grids(
    folder: Path, tiled: set[tuple[int, int]]
) -> None:
    statuses = {p.stem: _load(p.stem, folder)["status"] for p in folder.glob("*.json")}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n, folder)["response"]["error"]["code"] == 400 for n in REFUSED)
    assert len(statuses) - len(REFUSED) >= 12
    grids = set()
    for name in statuses:
        metadata = (_load(name, folder)["response"].get("features") or {}).get("mm_metadata")
        for item in (metadata or {}).get("image", []):
            grids.add(tuple(decode_item(item)["images_spatial_crop"][0].array().tolist()))
    assert tiled <= grids  # untiled images, a tall one cut into 1 x 3 views (and a wide one)


@pytest.mark.parametrize("name", CASES)
def test_deepseek_ocr2_images_match_vllm(live_server_deepseek_ocr2: Any, name: str) -> None:
    case = _load(name)
    assert_matches_recorded(live_server_deepseek_ocr2.url, case, name, timeout=120)
    _check_ranges(case, name, _range_length)


@pytest.mark.parametrize("name", CASES_V1)
def test_deepseek_ocr_images_match_vllm(live_server_deepseek_ocr: Any, name: str) -> None:
    case = _load(name, FIXTURES_V1)
    assert_matches_recorded(live_server_deepseek_ocr.url, case, name, timeout=120)
    _check_ranges(case, name, _range_length_v1)


def _check_ranges(case: dict[str, Any], name: str, length: Callable[[int, int], int]) -> None:
    """Each placeholder range is the token count of its item's grid."""
    if case["status"] != 200:
        return
    features = case["response"]["features"]
    metadata = features["mm_metadata"]
    if metadata is None:  # mm_payload "none"
        return
    ranges = features["mm_placeholders"]["image"]
    for item, r in zip(metadata["image"], ranges, strict=True):
        fields = decode_item(item)
        assert list(fields) == ["images_spatial_crop"]
        cols, rows = fields["images_spatial_crop"][0].array().tolist()
        assert r["length"] == length(cols, rows), (name, r, cols, rows)
