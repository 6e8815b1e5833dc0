"""aiomm serve against responses recorded from vLLM 0.33's own render server.

Every fixture in ``fixtures/`` is a request body and vLLM's response (see
``record_fixtures.py``); aiomm must give the same token ids, placeholders, mm_hashes, metadata,
sampling params and tensors bit for bit (images and videos), and its msgpack items must decode
to the same structure (and, with vLLM's key order, the same bytes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: videos rendered for a Qwen2.5-VL folder: ``second_per_grid_ts`` (bfloat16, kept on the CPU)
FIXTURES_QWEN2_5 = Path(__file__).parent / "fixtures_qwen2_5_vl"
CASES_QWEN2_5 = sorted(p.stem for p in FIXTURES_QWEN2_5.glob("*.json"))
#: videos rendered for a Qwen3-VL folder: timestamps interleaved in the prompt and sent in the items
FIXTURES_QWEN3 = Path(__file__).parent / "fixtures_qwen3_vl"
CASES_QWEN3 = sorted(p.stem for p in FIXTURES_QWEN3.glob("*.json"))
#: videos rendered for a GLM-4.1V folder: per-frame timestamps as text, whole-block placeholders
FIXTURES_GLM4V = Path(__file__).parent / "fixtures_glm4v"
CASES_GLM4V = sorted(p.stem for p in FIXTURES_GLM4V.glob("*.json"))
#: the GLM-4V folder's ``<|begin_of_video|>`` and ``<|end_of_video|>`` ids
_GLM_VIDEO_DELIMITERS = (347, 348)
#: videos rendered for a GLM-OCR folder: vLLM's glm46v loader, whole-second timestamps
FIXTURES_GLM_OCR = Path(__file__).parent / "fixtures_glm_ocr"
CASES_GLM_OCR = sorted(p.stem for p in FIXTURES_GLM_OCR.glob("*.json"))
#: images rendered for ``aiomm serve mistral3``'s folder: only ``pixel_values``, no metadata
FIXTURES_MISTRAL3 = Path(__file__).parent / "fixtures_mistral3"
CASES_MISTRAL3 = sorted(p.stem for p in FIXTURES_MISTRAL3.glob("*.json"))
#: images rendered for ``aiomm serve llama-nemotron-vl-embed``'s folder (items as digests):
#: ``pixel_values_flat`` and the image token's id, as vLLM's InternVL-style items
FIXTURES_NEMOTRON_VL = Path(__file__).parent / "fixtures_nemotron_vl"
CASES_NEMOTRON_VL = sorted(p.stem for p in FIXTURES_NEMOTRON_VL.glob("*.json"))


def _load(name: str, folder: Path = FIXTURES) -> dict[str, Any]:
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_matches_vllm(live_server: Any, name: str) -> None:
    assert_matches_recorded(live_server.url, _load(name), name)


@pytest.mark.parametrize("name", CASES_QWEN2_5)
def test_qwen2_5_vl_videos_match_vllm(live_server_qwen2_5: Any, name: str) -> None:
    case = _load(name, FIXTURES_QWEN2_5)
    assert_matches_recorded(live_server_qwen2_5.url, case, name)
    metadata = case["response"]["features"]["mm_metadata"]
    if metadata is not None:  # the field this folder exists for
        assert all("second_per_grid_ts" in decode_item(m) for m in metadata["video"])


@pytest.mark.parametrize("name", CASES_QWEN3)
def test_qwen3_vl_videos_match_vllm(live_server_qwen3: Any, name: str) -> None:
    case = _load(name, FIXTURES_QWEN3)
    assert_matches_recorded(live_server_qwen3.url, case, name)
    metadata = case["response"]["features"]["mm_metadata"]
    if metadata is not None:  # the field Qwen3-VL adds to a video item
        assert all("timestamps" in decode_item(m) for m in metadata.get("video", []))


@pytest.mark.parametrize("name", CASES_GLM4V)
def test_glm4v_videos_match_vllm(live_server_glm4v: Any, name: str) -> None:
    case = _load(name, FIXTURES_GLM4V)
    assert_matches_recorded(live_server_glm4v.url, case, name)
    if case["status"] != 200:  # one video per prompt
        return
    features = case["response"]["features"]
    ids = case["response"]["token_ids"]
    for r in features["mm_placeholders"]["video"]:  # the range spans the delimiters too
        first, last = ids[r["offset"]], ids[r["offset"] + r["length"] - 1]
        assert (first, last) == _GLM_VIDEO_DELIMITERS
    if features["mm_metadata"] is not None:  # null with mm_payload "none"
        assert all("timestamps" not in decode_item(m) for m in features["mm_metadata"]["video"])


@pytest.mark.parametrize("name", CASES_GLM_OCR)
def test_glm_ocr_videos_match_vllm(live_server_glm_ocr: Any, name: str) -> None:
    case = _load(name, FIXTURES_GLM_OCR)
    assert_matches_recorded(live_server_glm_ocr.url, case, name)
    if name != "video_one_second":  # the clip the checks below describe
        return
    ids = case["response"]["token_ids"]
    # vLLM's timestamps are whole seconds: the 3 patches (frames 0, 3 and 6 of 8 at 8 fps) all
    # read "0.0 seconds", where HF's would read 0.0, 0.4 and 0.8
    (r,) = case["response"]["features"]["mm_placeholders"]["video"]
    # the video delimiters, then per patch <|begin_of_image|>, one <|image|>, <|end_of_image|>
    # and the two words of its timestamp
    assert r["length"] == 2 + 3 * 5
    assert len({ids[r["offset"] + 4 + 5 * k] for k in range(3)}) == 1  # one timestamp word


@pytest.mark.parametrize("name", CASES_MISTRAL3)
def test_mistral3_images_match_vllm(live_server_mistral3: Any, name: str) -> None:
    case = _load(name, FIXTURES_MISTRAL3)
    assert_matches_recorded(live_server_mistral3.url, case, name)
    features = case["response"]["features"]
    assert features["mm_metadata"] is None  # no field of Mistral 3's is kept on the CPU
    if features["kwargs_data"] is None:  # mm_payload "none"
        return
    assert all(list(decode_item(i)) == ["pixel_values"] for i in features["kwargs_data"]["image"])


@pytest.mark.parametrize("name", CASES_NEMOTRON_VL)
def test_nemotron_vl_images_match_vllm(live_server_nemotron_vl: Any, name: str) -> None:
    case = _load(name, FIXTURES_NEMOTRON_VL)
    assert_matches_recorded(live_server_nemotron_vl.url, case, name)
    metadata = case["response"]["features"]["mm_metadata"]
    if metadata is None:  # mm_payload "none"
        return
    assert all(
        set(decode_item(m)) == {"image_token_id", "image_num_patches"} for m in metadata["image"]
    )


def test_fixtures_cover_the_acceptance_cases() -> None:
    wanted = {
        "chat_jpeg",
        "chat_two_images",
        "chat_rgba",
        "chat_exif_rotated",
        "chat_greyscale",
        "chat_image_first",
        "chat_system",
        "chat_multi_turn",
        "responses_input_image",
        "messages_anthropic",
        "chat_mm_none",
        # videos (video_url parts): H.264/MP4, VP9/WebM, MPEG-4, VP8/WebM
        "video_h264",
        "video_webm_vp9",
        "video_and_image",
        "video_two",
        "video_mm_none",
        "video_uuid",
        "video_hashed_frames",  # encoded bytes above the sampled frames': vLLM hashes the frames
        "video_odd_frame_count",  # vLLM's clamped index range: 15 frames
        "video_vfr_mkv",  # variable frame rates: OpenCV's end-of-stream position as the count
        "video_vfr_mp4",
        "error_bad_video",
    }
    assert wanted <= set(CASES)
    assert {"video_h264", "video_and_image", "video_two", "video_mm_none"} <= set(CASES_QWEN2_5)
    assert {"video_h264", "video_and_image", "video_two", "video_mm_none"} <= set(CASES_QWEN3)
    # images are one batch (each item carries the batch's slices), videos one each
    assert "chat_two_images" in CASES_QWEN3
    assert {"chat_jpeg", "chat_two_images", "chat_mm_none"} <= set(CASES_MISTRAL3) & set(
        CASES_NEMOTRON_VL
    )
    assert {"chat_phone_photo_48mp", "chat_png_without_iend", "error_image_aspect_ratio"} <= set(
        CASES
    )
    assert {"video_short", "video_three_frames", "video_two_short", "video_mm_none"} <= set(
        CASES_GLM4V
    )
    # every video-capable family has a video case with mm_payload "none"
    assert {"video_one_second", "video_mm_none"} <= set(CASES_GLM_OCR)
    files = [
        *FIXTURES.glob("*.json"),
        *FIXTURES_QWEN2_5.glob("*.json"),
        *FIXTURES_QWEN3.glob("*.json"),
        *FIXTURES_GLM4V.glob("*.json"),
        *FIXTURES_GLM_OCR.glob("*.json"),
        *FIXTURES_MISTRAL3.glob("*.json"),
        *FIXTURES_NEMOTRON_VL.glob("*.json"),
    ]
    # the image and video cases are most of it (Qwen3-VL's two images alone 1.2 MB: its images
    # are upscaled to 64 Ki pixels at least); the request-field cases add about 40 KiB
    assert sum(p.stat().st_size for p in files) < 7 << 20
