"""Record vLLM's mm_hash of audio items: what ``tests/engine/test_audio.py`` checks
:func:`aiomm.vllm.mm_hash.audio_mm_hash` and the engine's ``VllmHasher`` path against.

Run with the interpreter of a vLLM 0.33 install with ``vllm[audio]``::

    PYTHONPATH=tests/support /tmp/vllm-venv/bin/python tests/engine/record_audio_hashes.py

Two kinds of entries: arrays (built from a seed as :func:`arrays` builds them, hashed as vLLM
hashes an audio item, ``MultiModalHasher.hash_kwargs(model_id=..., audio=array)``), and encoded
clips of ``tests/support/audio_samples.py`` loaded (``AudioMediaIO``) and parsed
(``MultiModalDataParser(target_sr=16000, target_channels=1)``) as vLLM's render server does
before it hashes them.

``tests/engine/fixtures_audio_hashes.json`` was recorded this way with vLLM 0.33 (blake3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from audio_samples import CASES, encode

MODEL_ID = "/tmp/vllm-probe/qwen2-audio"
#: clips whose bytes every run encodes alike (PCM WAV, FLAC)
CLIPS = (
    "wav_8k_mono_pcm16",
    "wav_16k_mono_pcm16",
    "wav_44100_stereo_pcm16",
    "wav_48k_stereo_pcm24",
    "flac_44100_stereo",
)


def arrays() -> dict[str, np.ndarray]:
    """Waveforms of several lengths and layouts, the same bits on every run."""
    rng = np.random.default_rng(20261206)
    out = {
        "one_sample": np.array([0.25], np.float32),
        "short_f32": rng.standard_normal(160).astype(np.float32),
        "second_f32": rng.standard_normal(16000).astype(np.float32),
        "odd_f32": rng.standard_normal(12345).astype(np.float32),
        "f64": rng.standard_normal(999),
    }
    # a strided view: vLLM copies it before hashing (the bytes of its values, C order)
    out["strided_f32"] = rng.standard_normal(4000).astype(np.float32)[::2]
    return out


def main() -> None:
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.audio import AudioMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("fixtures_audio_hashes.json")
    )
    args = parser.parse_args()

    def mm_hash(audio: Any) -> str:
        return MultiModalHasher.hash_kwargs("blake3", model_id=MODEL_ID, audio=audio)

    recorded_arrays = {name: mm_hash(array) for name, array in arrays().items()}
    clips: dict[str, Any] = {}
    for case in CASES:
        if case.name not in CLIPS:
            continue
        audio, rate = AudioMediaIO().load_bytes(encode(case))
        items = MultiModalDataParser(target_sr=16000, target_channels=1).parse_mm_data(
            {"audio": [(audio, rate)]}
        )
        parsed = items["audio"].get_all_items_for_hash()[0]
        clips[case.name] = {"len": int(parsed.shape[0]), "mm_hash": mm_hash(parsed)}
    args.out.write_text(
        json.dumps({"model_id": MODEL_ID, "arrays": recorded_arrays, "clips": clips}, indent=1)
        + "\n"
    )
    print(f"wrote {len(recorded_arrays)} arrays and {len(clips)} clips to {args.out}")


if __name__ == "__main__":
    main()
