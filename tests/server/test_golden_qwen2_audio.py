"""``aiomm serve qwen2-audio`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_qwen2_audio/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("qwen2-audio", ...)`` writes, with two clips allowed
per prompt: ``input_audio`` parts and ``audio_url`` data URLs of WAV, FLAC, MP3 and Ogg Vorbis
clips, mono and stereo, at 8 to 48 kHz, from 0.1 s to 60 s (cut to Whisper's 30 s window),
decoded at their own rate, their channels averaged, resampled to 16 kHz and turned into log-mel
``input_features`` with their ``feature_attention_mask``. Each clip's ``<|AUDIO|>`` becomes one
token per 40 ms of (cut) audio; a corrupt clip is refused, alone or beside a good one, and so is
an image (the model takes none).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from render_compare import assert_matches_recorded

FIXTURES = Path(__file__).parent / "fixtures_qwen2_audio"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: corrupt clips, and an image
REFUSED = {"error_audio_corrupt", "error_audio_one_of_two_corrupt", "error_image_to_audio_model"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _audio_tokens(seconds: float) -> int:
    """``<|AUDIO|>`` tokens of a clip (vLLM's ``_get_feat_extract_output_lengths`` of its mel
    frames, 100 a second, at most Whisper's 3000)."""
    frames = min(round(seconds * 100), 3000)
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def test_the_fixtures_cover_codecs_lengths_parts_and_refusals() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert all(_load(n)["response"]["error"]["code"] == 400 for n in REFUSED)
    assert len(statuses) - len(REFUSED) >= 12
    lengths, kinds = set(), set()
    for name in CASES:
        case = _load(name)
        for message in case["body"]["messages"]:
            if isinstance(message["content"], list):
                kinds |= {p.get("type") for p in message["content"] if isinstance(p, dict)}
        features = case["response"].get("features") or {}
        lengths |= {r["length"] for r in (features.get("mm_placeholders") or {}).get("audio", [])}
    assert {"input_audio", "audio_url"} <= kinds
    # the 0.1 s clip, a second, and the 60 s clip cut to the 30 s window
    assert {_audio_tokens(0.1), _audio_tokens(1.0), _audio_tokens(60)} <= lengths
    assert _audio_tokens(60) == 750


@pytest.mark.parametrize("name", CASES)
def test_qwen2_audio_clips_match_vllm(live_server_qwen2_audio: Any, name: str) -> None:
    assert_matches_recorded(live_server_qwen2_audio.url, _load(name), name, timeout=120)
