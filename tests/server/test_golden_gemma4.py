"""``aiomm serve gemma4`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_gemma4/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("gemma4", ...)`` writes: token ids, placeholder
ranges from ``<|image>`` to ``<image|>``, ``pixel_values`` (each image's 16-px patches, rescaled
on the host and padded with zero patches to 280 x 9 rows) and ``pixel_position_ids``; no image
field is kept on the CPU, so image items have no ``mm_metadata``. A bad image is refused, alone
or beside a good one. The ``video_*`` cases (vLLM's default loader: every frame up to 32, else 32
spread evenly) carry each frame as an image of at most 70 soft tokens after its ``mm:ss``
timestamp; their ``video_frame_counts``, ``video_num_soft_tokens`` and ``video_timestamps`` are
kept on the CPU (``mm_metadata``). A corrupt video is refused, and so is a video beside an image
(vLLM 0.33's own 400: the images' ``mm_metadata`` and the videos' disagree).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_gemma4"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: undecodable images, a corrupt video, a video beside an image
REFUSED = {"error_bad_image", "error_one_of_two_images_bad", "error_bad_video", "video_and_image"}
#: the video cases, and each video's frames as vLLM's default loader reads them, and the soft
#: tokens of its frames (70 at most)
VIDEO_FRAMES = {
    "video_short": [(10, 63)],  # 40 x 30, 10 frames
    "video_h264": [(20, 60)],
    "video_webm_vp9": [(16, 60)],
    "video_hashed_frames": [(20, 64)],  # hashed over its frames (smaller than the file)
    "video_odd_frame_count": [(32, 64)],  # 34 frames: 32 spread evenly
    "video_two": [(12, 63), (20, 60)],
}


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
    assert set(VIDEO_FRAMES) | {"video_mm_none"} <= set(CASES)


def test_video_fixtures() -> None:
    """Each video's range: per frame its timestamp (one token of the offline tokenizer), then
    ``<|image>``, the soft tokens and ``<image|>``; its CPU fields in ``mm_metadata``, the
    frame times ``index / fps`` of the source's frames."""
    for name, frames in VIDEO_FRAMES.items():
        features = _load(name)["response"]["features"]
        lengths = [r["length"] for r in features["mm_placeholders"]["video"]]
        assert lengths == [t * (n + 3) for t, n in frames], name
        metadata = [decode_item(m) for m in features["mm_metadata"]["video"]]
        for meta, (t, n) in zip(metadata, frames, strict=True):
            assert list(meta) == ["video_timestamps", "video_num_soft_tokens", "video_frame_counts"]
            assert meta["video_num_soft_tokens"][0] == [n] * t, name
            seconds = meta["video_timestamps"][0]
            assert len(seconds) == t and seconds[0] == 0.0 and seconds == sorted(seconds), name
    both = _load("video_and_image")["response"]["error"]["message"]
    assert "mm_metadata must use the same modalities" in both
    none = _load("video_mm_none")["response"]["features"]
    assert set(none["mm_placeholders"]) == {"image", "video"} and none["kwargs_data"] is None


@pytest.mark.parametrize("name", CASES)
def test_gemma4_matches_vllm(live_server_gemma4: Any, name: str) -> None:
    case = _load(name)
    assert_matches_recorded(live_server_gemma4.url, case, name, timeout=120)
    if case["status"] != 200:
        return
    features = case["response"]["features"]
    if name not in VIDEO_FRAMES:
        assert not features["mm_metadata"], name
    for r in features["mm_placeholders"].get("image", []):
        # some image size gives this count (280 soft tokens at most, 1 at least)
        assert 1 <= r["length"] - 2 <= 280, (name, r)
