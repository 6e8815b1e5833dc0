"""aiomm.media.audio against vLLM 0.33's own loader and resamplers, replayed from
``fixtures_audio.json`` (recorded by ``record_audio_fixtures.py`` with vLLM's interpreter):
WAV at 8 to 48 kHz in mono and stereo, FLAC, MP3, Ogg Vorbis and Opus through libsndfile,
M4A/AAC and WebM/Opus through PyAV; then the typed errors."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from audio_samples import CASES, AudioCase, encode

from aiomm.errors import (
    AudioDecodeError,
    AudioTooLargeError,
    AudioTooLongError,
    DecodeError,
    EmptyAudioError,
)
from aiomm.media.audio import RESAMPLE_METHODS, decode_audio, load_audio, resample_audio

FIXTURES = json.loads((Path(__file__).parent / "fixtures_audio.json").read_text())


def _sha(audio: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(audio).tobytes()).hexdigest()


def _assert_matches(audio: np.ndarray, recorded: dict[str, Any]) -> None:
    assert audio.ndim == 1
    assert str(audio.dtype) == recorded["dtype"]
    assert audio.shape[0] == recorded["len"]
    assert audio[:4].tolist() == recorded["head"]
    assert _sha(audio) == recorded["sha256"]


def _case_bytes(case: AudioCase) -> bytes:
    entry = FIXTURES["cases"][case.name]
    data = base64.b64decode(entry["bytes_b64"]) if "bytes_b64" in entry else encode(case)
    # the test must feed vLLM's recorded input, else an encoder change would pass unnoticed
    assert hashlib.sha256(data).hexdigest() == entry["bytes_sha256"]
    return data


def test_every_case_was_recorded() -> None:
    assert set(FIXTURES["cases"]) == {case.name for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_native_decode_equals_vllm_loader(case: AudioCase) -> None:
    entry = FIXTURES["cases"][case.name]
    audio, rate = load_audio(_case_bytes(case))
    assert rate == entry["native_rate"] == case.rate
    _assert_matches(audio, entry["native"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decode_to_16k_equals_vllm_parser(case: AudioCase) -> None:
    """The default method is vLLM's (torchaudio's windowed sinc) and the result float32 mono."""
    audio = decode_audio(_case_bytes(case), target_rate=16000)
    assert audio.dtype == np.float32
    _assert_matches(audio, FIXTURES["cases"][case.name]["resampled"]["torchaudio"])


@pytest.mark.parametrize("method", RESAMPLE_METHODS)
def test_every_resampling_method_equals_vllm(method: str) -> None:
    for case in CASES:
        audio, rate = load_audio(_case_bytes(case))
        out = resample_audio(audio, orig_rate=rate, target_rate=16000, method=method)
        _assert_matches(out, FIXTURES["cases"][case.name]["resampled"][method])


def test_resampling_does_not_depend_on_torch_threads() -> None:
    case = next(c for c in CASES if c.name == "wav_44100_mono_pcm16_long")
    data = _case_bytes(case)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        audio = decode_audio(data, target_rate=16000)
    finally:
        torch.set_num_threads(before)
    _assert_matches(audio, FIXTURES["cases"][case.name]["resampled"]["torchaudio"])


def test_unknown_resampling_method_is_refused() -> None:
    with pytest.raises(AudioDecodeError, match="librosa"):
        resample_audio(
            np.zeros(10, np.float32), orig_rate=8000, target_rate=16000, method="librosa"
        )


#: how aiomm reports each input vLLM rejects (or returns nothing for)
ERROR_CLASSES: dict[str, type[DecodeError] | None] = {
    "empty_bytes": EmptyAudioError,
    "zero_frame_wav": EmptyAudioError,
    "random_bytes": AudioDecodeError,
    "wav_header_only": AudioDecodeError,
    "wav_truncated": None,  # libsndfile reads the samples that are there, in vLLM too
    "flac_truncated": AudioDecodeError,
    "flac_corrupt_body": AudioDecodeError,
    "m4a_truncated": AudioDecodeError,
    "wav_too_long": AudioTooLongError,
    "m4a_too_long": AudioTooLongError,
    "wav_too_many_bytes": AudioTooLargeError,
    "m4a_too_many_bytes": AudioTooLargeError,
}


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
def test_bad_input_fails_where_vllm_fails(name: str) -> None:
    recorded = FIXTURES["errors"][name]
    data = base64.b64decode(recorded["bytes_b64"])
    expected = ERROR_CLASSES[name]
    if expected is None:
        assert "raised" not in recorded
        audio, rate = load_audio(data, **recorded["limits"])
        assert rate == recorded["native_rate"]
        _assert_matches(audio, recorded["native"])
        return
    if name == "zero_frame_wav":
        # vLLM hands on zero samples; aiomm refuses them at decode
        assert recorded["native"]["len"] == 0
    else:
        assert recorded["raised"] in ("ValueError", "LibsndfileError")
    with pytest.raises(expected) as info:
        load_audio(data, **recorded["limits"])
    message = str(info.value)
    # the message names the problem, never the payload
    assert len(message) < 200 and "\\x" not in message
    assert isinstance(info.value, ValueError)


def test_limit_errors_carry_their_fields() -> None:
    wav = encode(AudioCase("one_s", "WAV", "PCM_16", 8000, 2, seconds=1.0))
    with pytest.raises(AudioTooLongError, match=r"limit of 0.5 s \(1.0 s at 8000 Hz\)") as long:
        decode_audio(wav, target_rate=16000, max_duration_s=0.5)
    assert long.value.limit_s == 0.5
    with pytest.raises(AudioTooLargeError, match="8000 frames x 2 channels") as large:
        decode_audio(wav, target_rate=16000, max_decode_bytes=64_000 - 1)
    assert (large.value.size, large.value.limit) == (64_000, 63_999)
    # exactly at the limits passes, as in vLLM (its checks are strict >)
    assert decode_audio(wav, target_rate=8000, max_duration_s=1.0, max_decode_bytes=64_000).shape
    with pytest.raises(AudioTooLargeError, match="encoded audio") as encoded:
        decode_audio(wav, target_rate=16000, max_encoded_bytes=len(wav) - 1)
    assert encoded.value.size == len(wav)


def test_no_audio_stream_is_empty_audio() -> None:
    from video_samples import frames_of, make_video

    with pytest.raises(EmptyAudioError, match="no audio stream"):
        load_audio(make_video(frames_of(2, 16, 16)))


def test_concurrent_decodes_agree_with_vllm() -> None:
    """Worker threads decode at once (the kernel cache and the decoders hold no shared state)."""
    from concurrent.futures import ThreadPoolExecutor

    inputs = [(case, _case_bytes(case)) for case in CASES] * 2
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda item: decode_audio(item[1], target_rate=16000), inputs))
    for (case, _), audio in zip(inputs, outputs, strict=True):
        _assert_matches(audio, FIXTURES["cases"][case.name]["resampled"]["torchaudio"])


def test_a_rate_needing_a_huge_resampling_kernel_is_refused() -> None:
    """A header's 44101 Hz would need a 16000 x 44135 kernel; odd real rates still resample."""
    with pytest.raises(AudioDecodeError, match="44101 Hz to 16000 Hz"):
        resample_audio(np.zeros(100, np.float32), orig_rate=44101, target_rate=16000)
    for rate in (12345, 44056):
        out = resample_audio(np.ones(rate // 10, np.float32), orig_rate=rate, target_rate=16000)
        assert out.shape == (1600,)
