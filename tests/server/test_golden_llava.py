"""``aiomm serve llava-next`` and ``aiomm serve llava-onevision`` against responses recorded from
vLLM 0.33's render server for the same offline folders (``fixtures_llava_next/``,
``fixtures_llava_onevision/``; items kept as digests: each is megabytes of bfloat16 patches).
OneVision's ``video_*`` cases add videos: vLLM's default loader's frames (32 at most),
``pixel_values_videos`` ``[frames, 3, 384, 384]`` per video (batched, no field on the CPU).

vLLM's LLaVA items are rows of HF's padded batch: ``pixel_values`` ``[most patches, 3, side,
side]`` (normalised, in the model's dtype) with ``image_sizes`` kept on the CPU (``mm_metadata``);
aiomm's items hold their own patches and the server pads them per request, which
``chat_tiled_images`` (three grids in one request) pins down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import Field, decode_item

HERE = Path(__file__).parent
FIXTURES = {"next": HERE / "fixtures_llava_next", "onevision": HERE / "fixtures_llava_onevision"}
CASES = {
    family: sorted(p.stem for p in folder.glob("*.json")) for family, folder in FIXTURES.items()
}
#: the recorded (height, width) of chat_tiled_images' three images
_TILED_SIZES = ([400, 700], [900, 300], [72, 96])


def _load(family: str, name: str) -> dict[str, Any]:
    return json.loads((FIXTURES[family] / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES["next"])
def test_llava_next_matches_vllm(live_server_llava_next: Any, name: str) -> None:
    assert_matches_recorded(live_server_llava_next.url, _load("next", name), name)


@pytest.mark.parametrize("name", CASES["onevision"])
def test_llava_onevision_matches_vllm(live_server_llava_onevision: Any, name: str) -> None:
    assert_matches_recorded(live_server_llava_onevision.url, _load("onevision", name), name)


#: OneVision's video cases, and each video's frames as vLLM's default loader reads them (every
#: frame up to 32, else 32 spread evenly): 196 tokens a frame and a newline
_VIDEO_FRAMES = {
    "video_short": [10],
    "video_h264": [20],
    "video_webm_vp9": [16],
    "video_hashed_frames": [20],
    "video_odd_frame_count": [32],  # 34 frames
    "video_vfr_mp4": [32],  # 82 in the header, 80 presentable
    "video_two": [12, 20],
}


def test_onevision_video_fixtures() -> None:
    """The video cases: each ``<video>`` expanded to ``196 * frames + 1`` tokens, one item per
    video (no field kept on the CPU, so no ``mm_metadata``); a video with an image is a 400 in
    vLLM 0.33 (its images' ``mm_metadata`` and its videos' none disagree on the modalities)
    unless the request asks for no payload; a corrupt video is a 400."""
    for name, frames in _VIDEO_FRAMES.items():
        features = _load("onevision", name)["response"]["features"]
        lengths = [r["length"] for r in features["mm_placeholders"]["video"]]
        assert lengths == [196 * t + 1 for t in frames], name
        assert len(features["kwargs_data"]["video"]) == len(frames)
        assert features["mm_metadata"] is None, name
    both = _load("onevision", "video_and_image")
    assert both["status"] == 400
    assert "mm_metadata must use the same modalities" in both["response"]["error"]["message"]
    none = _load("onevision", "video_mm_none")["response"]["features"]
    assert set(none["mm_placeholders"]) == {"image", "video"} and none["kwargs_data"] is None
    assert _load("onevision", "error_bad_video")["status"] == 400


def test_onevision_video_with_media_io_kwargs_is_refused(live_server_llava_onevision: Any) -> None:
    """vLLM would sample with a request's ``media_io_kwargs`` (another frame count): aiomm
    refuses them (a 400 naming the parameter) rather than sample otherwise."""
    case = _load("onevision", "video_short")
    body = {**case["body"], "media_io_kwargs": {"video": {"num_frames": 4}}}
    refused = httpx.post(live_server_llava_onevision.url + case["path"], json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "media_io_kwargs"


@pytest.mark.parametrize("family", ["next", "onevision"])
def test_the_fixtures_cover_the_cases(family: str) -> None:
    assert {
        "chat_jpeg", "chat_two_images", "chat_tiled_images", "chat_rgba", "chat_greyscale",
        "chat_palette", "chat_multi_turn", "chat_system", "chat_mm_none",
        "error_one_of_two_images_bad",
    } <= set(CASES[family])  # fmt: skip
    assert _load(family, "error_one_of_two_images_bad")["status"] == 400
    # vLLM takes the LLaVA families' thinnest images (Qwen-VL's aspect-ratio refusal is not theirs)
    assert _load(family, "error_image_aspect_ratio")["status"] == 200


@pytest.mark.parametrize(
    ("family", "lengths"), [("next", [1948, 2376, 1368]), ("onevision", [2379, 2997, 1317])]
)
def test_items_are_the_requests_padded_batch(family: str, lengths: list[int]) -> None:
    """Every item of a request has the request's most patches (equal base64 lengths: same
    shapes), and ``image_sizes`` is batched and kept on the CPU."""
    features = _load(family, "chat_tiled_images")["response"]["features"]
    items = features["kwargs_data"]["image"]
    assert len(items) == 3 and len({item["chars"] for item in items}) == 1
    assert [r["length"] for r in features["mm_placeholders"]["image"]] == lengths
    for meta, size in zip(features["mm_metadata"]["image"], _TILED_SIZES, strict=True):
        ((value, field),) = decode_item(meta).values()
        assert torch.equal(torch.from_numpy(value.array().copy()), torch.tensor(size))
        assert field == Field("batched", {"keep_on_cpu": True})
