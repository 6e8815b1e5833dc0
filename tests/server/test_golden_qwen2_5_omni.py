"""``aiomm serve qwen2.5-omni`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_qwen2_5_omni/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("qwen2.5-omni", ...)`` writes, with four images, two
videos and two clips allowed per prompt: images (normalised on the host: vLLM's Qwen2.5-Omni
takes normalised pixels), videos (``second_per_grid_ts`` and the shared ``use_audio_in_video``),
clips (``input_audio_features`` of each clip's own frames, flat along dim 1; its
``audio_feature_lengths`` and 300-s ``feature_attention_mask`` kept on the CPU, so also in
``mm_metadata``), and requests mixing them. A clip of a minute is kept whole (Qwen2-Audio's
30-s window does not apply); a corrupt or too short clip, a bad image and a bad video are
refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded, assert_modalities_in_recorded_order

FIXTURES = Path(__file__).parent / "fixtures_qwen2_5_omni"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses
REFUSED = {"error_audio_corrupt", "error_audio_too_short", "error_bad_image", "error_bad_video"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_the_fixtures_cover_every_modality_together_and_the_refusals() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    modalities = {
        name: set((_load(name)["response"].get("features") or {}).get("mm_placeholders") or {})
        for name in CASES
    }
    assert {"image", "audio"} <= modalities["omni_image_and_audio"]
    assert {"video", "audio"} <= modalities["omni_video_and_audio"]
    # a minute of audio: 6000 feature frames, 1500 tokens (no 30 s cut)
    (clip,) = _load("audio_ogg_60s")["response"]["features"]["mm_placeholders"]["audio"]
    assert clip["length"] == 1500


@pytest.mark.parametrize("name", CASES)
def test_qwen2_5_omni_matches_vllm(live_server_qwen2_5_omni: Any, name: str) -> None:
    assert_matches_recorded(live_server_qwen2_5_omni.url, _load(name), name, timeout=120)


#: the cases whose items are of more than one modality
MIXED = (
    "omni_audio_image_audio",
    "omni_image_and_audio",
    "omni_video_and_audio",
    "video_and_image",
)


@pytest.mark.parametrize("name", MIXED)
def test_modalities_come_in_vllms_order(live_server_qwen2_5_omni: Any, name: str) -> None:
    """vLLM writes ``mm_hashes`` in its chat parser's order (images, audio, videos) and the
    placeholders, items and metadata in its processor's field order (audio, images, videos);
    the JSON comparison above does not see key order, so it is checked here."""
    assert_modalities_in_recorded_order(live_server_qwen2_5_omni.url, _load(name))
