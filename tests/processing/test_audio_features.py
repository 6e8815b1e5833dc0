"""aiomm.processing.audio_features equals transformers' WhisperFeatureExtractor bit for bit, as
the Qwen audio processors call it: ``padding="max_length"`` with truncation to 30 s
(Qwen2-Audio, Qwen2.5-Omni) and ``padding=True, truncation=False`` (Qwen3-Omni, whose clips
vLLM first pads to a multiple of the hop)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from aiomm.errors import ProcessingError
from aiomm.processing.audio_features import (
    FEW_FRAMES,
    WhisperFeatureConfig,
    last_frame_in_longer_batch,
    log_mel_features,
    num_feature_frames,
)

RATE = 16000
CONFIG = WhisperFeatureConfig()


@pytest.fixture(scope="module")
def hf() -> WhisperFeatureExtractor:
    """The Qwen2-Audio checkpoint's documented preprocessor_config.json."""
    return WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        padding_side="right",
        return_attention_mask=True,
    )


def _clip(samples: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / RATE
    speechy = np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) + 0.1 * rng.standard_normal(
        samples
    )
    return (0.4 * speechy).astype(np.float32)


def _assert_equal_to_hf(hf: WhisperFeatureExtractor, audio: np.ndarray, **kwargs: object) -> None:
    ref = hf(audio, sampling_rate=RATE, return_attention_mask=True, **kwargs)
    if kwargs.get("padding") == "max_length":
        got = log_mel_features(audio)
    else:
        got = log_mel_features(audio, pad_to=None, truncate=False)
    expected, mask = ref["input_features"][0], ref["attention_mask"][0]
    assert got.input_features.dtype == expected.dtype == np.float32
    assert got.input_features.shape == expected.shape
    np.testing.assert_array_equal(got.input_features, expected)
    assert got.attention_mask.dtype == mask.dtype
    np.testing.assert_array_equal(got.attention_mask, mask)


#: 0.1 s to 60 s, with lengths off the hop, around the 30 s chunk and short of a window
LENGTHS = (
    1600,
    1601,
    4000,
    RATE + 1,
    5 * RATE + 37,
    12 * RATE + 159,
    29 * RATE + 123,
    30 * RATE - 200,
    30 * RATE - 1,
    30 * RATE,
    30 * RATE + 1,
    45 * RATE + 80,
    60 * RATE,
)


@pytest.mark.parametrize("samples", LENGTHS)
def test_max_length_padding_with_truncation(hf: WhisperFeatureExtractor, samples: int) -> None:
    _assert_equal_to_hf(hf, _clip(samples, seed=samples), padding="max_length", truncation=True)


@pytest.mark.parametrize("samples", (*LENGTHS, 401, 3 * 160, 2 * RATE + 7))
def test_longest_padding_without_truncation(hf: WhisperFeatureExtractor, samples: int) -> None:
    """Qwen3-Omni: the whole clip, past 30 s too (its encoder windows the frames itself)."""
    _assert_equal_to_hf(hf, _clip(samples, seed=samples), padding=True, truncation=False)


@pytest.mark.parametrize("samples", (1, 5, 159, 160, 200, 399, 400, 1000))
def test_clips_shorter_than_a_few_frames(hf: WhisperFeatureExtractor, samples: int) -> None:
    _assert_equal_to_hf(hf, _clip(samples, seed=samples), padding="max_length")


def test_vllm_prepadded_qwen3_omni_clip(hf: WhisperFeatureExtractor) -> None:
    """vLLM pads a Qwen3-Omni clip with zeros to a multiple of the hop before HF sees it."""
    audio = _clip(7 * RATE + 33)
    padded = np.pad(audio, (0, -len(audio) % 160))
    _assert_equal_to_hf(hf, padded, padding=True, truncation=False)


@pytest.mark.parametrize("seconds", (0.5, 31.0))
def test_silence(hf: WhisperFeatureExtractor, seconds: float) -> None:
    silence = np.zeros(int(seconds * RATE), np.float32)
    _assert_equal_to_hf(hf, silence, padding="max_length")
    _assert_equal_to_hf(hf, silence, padding=True, truncation=False)


def test_empty_clip_is_all_padding(hf: WhisperFeatureExtractor) -> None:
    _assert_equal_to_hf(hf, np.zeros(0, np.float32), padding="max_length")


def test_clipping_and_out_of_range_samples(hf: WhisperFeatureExtractor) -> None:
    square = np.sign(_clip(3 * RATE)).astype(np.float32)  # a clipped signal: all +-1
    _assert_equal_to_hf(hf, square, padding="max_length")
    _assert_equal_to_hf(hf, square * 4.0, padding="max_length")
    _assert_equal_to_hf(hf, np.clip(_clip(RATE) * 6, -1, 1), padding=True, truncation=False)


def test_float64_input_is_taken_as_float32(hf: WhisperFeatureExtractor) -> None:
    audio = _clip(2 * RATE).astype(np.float64) * 1.1
    _assert_equal_to_hf(hf, audio, padding="max_length")


def test_a_batch_padded_to_its_longest_clip(hf: WhisperFeatureExtractor) -> None:
    """Several clips in one ``padding=True`` call: each is padded to the longest."""
    clips = [_clip(3 * RATE + 17, seed=1), _clip(RATE, seed=2), np.zeros(RATE // 2, np.float32)]
    ref = hf(clips, sampling_rate=RATE, return_attention_mask=True, padding=True, truncation=False)
    longest = max(len(c) for c in clips)
    for i, clip in enumerate(clips):
        got = log_mel_features(clip, pad_to=longest, truncate=False)
        np.testing.assert_array_equal(got.input_features, ref["input_features"][i])
        np.testing.assert_array_equal(got.attention_mask, ref["attention_mask"][i])


@pytest.mark.parametrize("samples", (1, 160, 161, 480_000, 480_001, 960_000))
def test_mask_and_frame_count(samples: int) -> None:
    for pad_to, truncate in ((480_000, True), (None, False)):
        if pad_to is None and samples <= 200:
            continue
        got = log_mel_features(np.zeros(samples, np.float32), pad_to=pad_to, truncate=truncate)
        frames = num_feature_frames(samples, pad_to=pad_to, truncate=truncate, config=CONFIG)
        assert got.input_features.shape == (128, frames)
        kept = min(samples, 480_000) if truncate else samples
        assert int(got.attention_mask.sum()) == min(frames, -(-kept // 160))


def test_bad_waveforms_are_refused() -> None:
    with pytest.raises(ProcessingError, match="1-D floating"):
        log_mel_features(np.zeros((2, 100), np.float32))
    with pytest.raises(ProcessingError, match="1-D floating"):
        log_mel_features(np.zeros(100, np.int16))
    with pytest.raises(ProcessingError, match="empty clip"):
        log_mel_features(np.zeros(0, np.float32), pad_to=None)
    with pytest.raises(ProcessingError, match="more than 200 samples"):
        log_mel_features(np.zeros(150, np.float32), pad_to=None)


@pytest.mark.parametrize("seed", range(4))
def test_the_last_frame_in_a_longer_batch_equals_hfs_batch(
    hf: WhisperFeatureExtractor, seed: int
) -> None:
    """The shortcut's last frame equals HF's batch of the clip beside a longer silent one, or it
    answers None (a peak it cannot place), for clips with plain and loud endings."""
    rng = np.random.default_rng(seed)
    answered = 0
    for case in range(25):
        frames = int(rng.choice([rng.integers(FEW_FRAMES, 40), rng.integers(40, 2000)]))
        audio = (0.2 * rng.standard_normal(frames * 160)).astype(np.float32)
        if case % 3 == 0:
            audio[-int(rng.integers(1, 400)) :] *= 30  # the loudest moment at the very end
        alone = log_mel_features(audio, pad_to=None, truncate=False)
        pads = [audio.shape[0] + 160, audio.shape[0] + 320, audio.shape[0] + 160 * 7]
        for pad_to, last in zip(pads, last_frame_in_longer_batch(audio, alone, pads), strict=True):
            batch = hf(
                [audio, np.zeros(pad_to, np.float32)], sampling_rate=RATE, padding=True,
                truncation=False, return_attention_mask=True, return_tensors="np",
            )["input_features"][0][:, :frames]  # fmt: skip
            if last is None:
                continue
            answered += 1
            where = f"seed={seed} case={case} frames={frames} pad_to={pad_to}"
            np.testing.assert_array_equal(last, batch[:, -1], err_msg=where)
            body = alone.input_features[:, :-1]
            np.testing.assert_array_equal(body, batch[:, :-1], err_msg=where)
    assert answered >= 40


def test_the_last_frame_shortcut_declines_what_it_cannot_answer() -> None:
    audio = _clip(160 * (FEW_FRAMES - 1))
    alone = log_mel_features(audio, pad_to=None, truncate=False)
    assert last_frame_in_longer_batch(audio, alone, [audio.shape[0] + 160]) == [None]
    audio = _clip(160 * 50 + 7)  # not a whole number of hops
    alone = log_mel_features(audio, pad_to=None, truncate=False)
    assert last_frame_in_longer_batch(audio, alone, [160 * 60]) == [None]


def test_the_mel_projection_rounds_alike_from_few_frames_up() -> None:
    """What :data:`FEW_FRAMES` and the last-frame shortcut rest on, checked on this machine's
    BLAS: a frame's mel projection is the same whatever its column among ``FEW_FRAMES`` or more
    frames (and another below that, which the shortcut never relies on)."""
    import torch

    from aiomm.processing.audio_features import _constants

    _, filters, _ = _constants(CONFIG)
    frame = torch.rand(201, generator=torch.Generator().manual_seed(0)) ** 4 * 100
    wide = torch.zeros(1, 201, 256)
    wide[0, :, 0] = frame
    want = (filters @ wide)[0, :, 0]
    for columns in range(FEW_FRAMES, 40):
        for column in (0, columns // 2, columns - 1):
            batch = torch.zeros(2, 201, columns)
            batch[0, :, column] = frame
            assert torch.equal((filters @ batch)[0, :, column], want), (columns, column)
