"""``aiomm serve qwen3-omni`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_qwen3_omni/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("qwen3-omni", ...)`` writes, with eight images, four
videos and eight clips allowed per prompt: images, videos, clips and requests mixing them, as
for Qwen2.5-Omni, and the clip lengths that matter to Qwen3-Omni, whose request pads each clip to
its longest: two clips one hop (160 samples) apart, a short one beside a long one, two clips of a
few frames, and a 100-sample clip, which renders beside a 2-s clip and is refused alone.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from render_compare import assert_matches_recorded, assert_modalities_in_recorded_order

from aiomm.adapters.qwen3_omni import audio_output_length
from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_qwen3_omni"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses
REFUSED = {
    "error_audio_corrupt",
    "error_audio_one_of_two_corrupt",
    "error_audio_too_short",
    "error_bad_image",
    "error_bad_video",
    "error_qwen3_tiny_alone",
}
#: the clip-length cases: each clip's samples (16-kHz WAVs)
QWEN3_CLIPS = {
    "qwen3_two_clips_one_hop_apart": (16000, 16160),
    "qwen3_two_clips_far_apart": (8000, 112000),
    "qwen3_tiny_clips": (700, 1500),
    "qwen3_tiny_beside_long": (100, 32000),
}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _samples(part: dict[str, Any]) -> int:
    import soundfile

    return soundfile.info(io.BytesIO(base64.b64decode(part["input_audio"]["data"]))).frames


def test_the_fixtures_cover_every_modality_together_and_the_refusals() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    modalities = {
        name: set((_load(name)["response"].get("features") or {}).get("mm_placeholders") or {})
        for name in CASES
    }
    assert modalities["omni_image_and_audio"] == {"image", "audio"}
    assert modalities["omni_video_and_audio"] == {"video", "audio"}
    assert modalities["omni_audio_image_audio"] == {"image", "audio"}
    assert modalities["video_and_image"] == {"image", "video"}
    # a minute of audio is kept whole: 6000 frames, 60 chunks of 100 frames, 13 tokens each
    (clip,) = _load("audio_ogg_60s")["response"]["features"]["mm_placeholders"]["audio"]
    assert clip["length"] == 780


@pytest.mark.parametrize("name", sorted(QWEN3_CLIPS))
def test_each_clip_keeps_its_own_frames_and_tokens(name: str) -> None:
    """Whatever the request's longest clip, vLLM gives each clip the frames of its own samples
    padded to the hop (a float32 mask of ones, its length in ``audio_feature_lengths``) and the
    tokens Qwen3-Omni's encoder rule gives those frames."""
    case = _load(name)
    parts = [p for p in case["body"]["messages"][0]["content"] if p["type"] == "input_audio"]
    assert tuple(_samples(p) for p in parts) == QWEN3_CLIPS[name]
    frames = [math.ceil(n / 160) for n in QWEN3_CLIPS[name]]
    features = case["response"]["features"]
    lengths = [p["length"] for p in features["mm_placeholders"]["audio"]]
    assert lengths == [audio_output_length(n) for n in frames]
    for n, item in zip(frames, features["mm_metadata"]["audio"], strict=True):
        fields = decode_item(item)
        mask = fields["feature_attention_mask"][0]
        assert (mask.dtype, mask.shape) == ("float32", (n,))
        assert np.all(mask.array() == 1)
        assert fields["audio_feature_lengths"][0].array().tolist() == n


@pytest.mark.parametrize("name", CASES)
def test_qwen3_omni_matches_vllm(live_server_qwen3_omni: Any, name: str) -> None:
    assert_matches_recorded(live_server_qwen3_omni.url, _load(name), name, timeout=120)


#: the cases whose items are of more than one modality
MIXED = (
    "omni_audio_image_audio",
    "omni_image_and_audio",
    "omni_video_and_audio",
    "video_and_image",
)


@pytest.mark.parametrize("name", MIXED)
def test_modalities_come_in_vllms_order(live_server_qwen3_omni: Any, name: str) -> None:
    """vLLM writes ``mm_hashes`` in its chat parser's order and the placeholders, items and
    metadata in its processor's field order; the JSON comparison above does not see key order,
    so it is checked here."""
    assert_modalities_in_recorded_order(live_server_qwen3_omni.url, _load(name))
