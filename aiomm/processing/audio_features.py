"""Whisper log-mel features, equal to ``transformers.WhisperFeatureExtractor.__call__`` (its torch
path, which transformers takes whenever torch is installed) as the Qwen audio processors call it.

HF pads every clip to ``pad_to`` samples (30 s for Qwen2-Audio and Qwen2.5-Omni), then runs
``torch.stft`` over the whole padded waveform. A frame whose window holds only padding is the
FFT of zeros, exactly 0, so its log-mel value is the constant ``log10(1e-10)`` before the
dynamic-range clamp. :func:`log_mel_features` runs the STFT only over the frames that hold signal
(plus enough zeros that none of them reaches the end's reflect padding) and fills the rest with
that constant. Every computed frame sees the same input window, the same ``torch.stft`` and the
same elementwise ops as in HF; the mel projection is the same float32 ``matmul`` over
201 frequency bins per frame, run over at least ``_MIN_COLUMNS`` frames (MKL's sgemm rounds
differently below about a dozen columns; HF always projects thousands). The peak of the clip
(the dynamic-range clamp's reference) is the max of the computed frames and the padding
constant, as HF's max over all frames is. So every value is bit-identical to HF's float32
output (max abs difference 0), asserted in ``tests/processing/test_audio_features.py`` for
0 to 60 s, silence, clipping, padding and truncation.

Callers run it in a worker thread: torch releases the GIL in the STFT and the matmul.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aiomm.errors import ProcessingError

__all__ = (
    "FEW_FRAMES",
    "AudioFeatures",
    "WhisperFeatureConfig",
    "feature_batch",
    "last_frame_in_longer_batch",
    "log_mel_features",
    "num_feature_frames",
)

#: the fewest frames the mel projection runs over (see :func:`log_mel_features`)
_MIN_COLUMNS = 256
#: below this many frames MKL's sgemm takes another path for the mel projection, whose rounding
#: depends on the frame count: a clip of fewer frames has other features alone than in a longer
#: batch, and a batch of such clips rounds as its longest clip's frame count has it
FEW_FRAMES = 12


@dataclass(frozen=True)
class WhisperFeatureConfig:
    """The ``WhisperFeatureExtractor`` parameters that shape the features; the defaults are the
    Qwen2-Audio, Qwen2.5-Omni and Qwen3-Omni checkpoints' (128 mel bins, 16 kHz, 30 s chunks)."""

    feature_size: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400

    @classmethod
    def of(cls, extractor: Any) -> WhisperFeatureConfig:
        """The parameters of a HF ``WhisperFeatureExtractor`` (or its stored snapshot)."""
        return cls(
            feature_size=int(extractor.feature_size),
            sampling_rate=int(extractor.sampling_rate),
            hop_length=int(extractor.hop_length),
            chunk_length=int(extractor.chunk_length),
            n_fft=int(extractor.n_fft),
        )

    @property
    def n_samples(self) -> int:
        """Samples in one chunk: what ``padding="max_length"`` pads and truncates to."""
        return self.chunk_length * self.sampling_rate


@dataclass(frozen=True)
class AudioFeatures:
    """One clip's features: ``input_features`` ``(feature_size, frames)`` float32 and
    ``attention_mask`` ``(frames,)`` int32 (1 where a frame's hop starts inside the clip), as
    HF returns them for a batch of one (``feature_attention_mask`` in the Qwen processors);
    ``peak``: the log-mel maximum the dynamic-range clamp took as its reference."""

    input_features: np.ndarray
    attention_mask: np.ndarray
    peak: float


@functools.lru_cache(maxsize=8)
def _constants(config: WhisperFeatureConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The Hann window, the float32 mel filters ``(mels, bins)`` and the log-mel value of an
    all-zero frame, computed as HF computes them."""
    from transformers.audio_utils import mel_filter_bank

    mel = mel_filter_bank(
        num_frequency_bins=1 + config.n_fft // 2,
        num_mel_filters=config.feature_size,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=config.sampling_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    filters = torch.from_numpy(mel).to(torch.float32).T
    window = torch.hann_window(config.n_fft)
    silent = float(torch.clamp(torch.zeros(1), min=1e-10).log10()[0])
    return window, filters, silent


def num_feature_frames(
    num_samples: int, *, pad_to: int | None, truncate: bool, config: WhisperFeatureConfig
) -> int:
    """How many feature frames :func:`log_mel_features` returns for a clip of ``num_samples``."""
    length = _kept_samples(num_samples, pad_to=pad_to, truncate=truncate)
    return max(length, pad_to or 0) // config.hop_length


def _kept_samples(num_samples: int, *, pad_to: int | None, truncate: bool) -> int:
    if truncate and pad_to is not None:
        return min(num_samples, pad_to)
    return num_samples


def log_mel_features(
    audio: np.ndarray,
    *,
    pad_to: int | None = 480_000,
    truncate: bool = True,
    config: WhisperFeatureConfig = WhisperFeatureConfig(),
) -> AudioFeatures:
    """The log-mel features HF's ``WhisperFeatureExtractor(audio, padding=..., truncation=...,
    return_attention_mask=True)`` returns for one mono clip at ``config.sampling_rate``.

    ``pad_to`` is the padded length in samples: ``config.n_samples`` for ``padding="max_length"``
    (Qwen2-Audio, Qwen2.5-Omni), ``None`` for ``padding="longest"`` of a single clip
    (Qwen3-Omni), or the batch's longest clip to reproduce a batched ``"longest"`` call.
    ``truncate`` cuts a clip longer than ``pad_to`` (HF's ``truncation=True``).

    :raises ProcessingError: ``audio`` is not a 1-D floating array, or is empty and not padded.
    """
    if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
        raise ProcessingError(
            f"audio features need a 1-D floating waveform, got {audio.dtype} {audio.shape}"
        )
    hop, n_fft = config.hop_length, config.n_fft
    length = _kept_samples(audio.shape[0], pad_to=pad_to, truncate=truncate)
    total = max(length, pad_to or 0)
    if total == 0:
        raise ProcessingError("audio features of an empty clip without padding")
    if total <= n_fft // 2:
        # torch.stft's reflect padding needs more samples than half a window
        raise ProcessingError(f"audio features need more than {n_fft // 2} samples, got {total}")
    window, filters, silent = _constants(config)
    frames = total // hop  # HF drops the STFT's last frame
    # frames 0 .. signal_frames-1 have a window touching the clip; the others see only zeros
    signal_frames = min(frames, -(-(length + n_fft // 2) // hop))
    # the shortest hop-aligned input whose frames < signal_frames end before its reflect padding
    span = -(-((signal_frames - 1) * hop + n_fft // 2) // hop) * hop
    span = max(span, -(-length // hop) * hop)
    if span >= total:
        span = total
    wave = torch.zeros(span, dtype=torch.float32)
    if length:
        wave[:length] = torch.from_numpy(np.ascontiguousarray(audio[:length], dtype=np.float32))
    stft = torch.stft(wave[None], n_fft, hop, window=window, return_complex=True)
    # MKL's sgemm takes another path (other rounding) for a handful of columns: project at least
    # _MIN_COLUMNS frames, zeros past the signal, as HF's thousands of columns do
    columns = max(signal_frames, min(frames, _MIN_COLUMNS))
    magnitudes = torch.zeros((1, filters.shape[1], columns), dtype=torch.float32)
    magnitudes[..., :signal_frames] = stft[..., :signal_frames].abs() ** 2
    log_spec = torch.clamp(filters @ magnitudes, min=1e-10).log10()[0, :, :signal_frames]
    out = torch.empty((config.feature_size, frames), dtype=torch.float32)
    peak = float(log_spec.max()) if signal_frames else silent
    if signal_frames < frames:
        peak = max(peak, silent)
    floor = torch.tensor(peak, dtype=torch.float32) - 8.0
    out[:, :signal_frames] = (torch.maximum(log_spec, floor) + 4.0) / 4.0
    if signal_frames < frames:
        out[:, signal_frames:] = (torch.maximum(torch.tensor(silent), floor) + 4.0) / 4.0
    mask = np.zeros(frames, dtype=np.int32)
    mask[: -(-length // hop)] = 1
    return AudioFeatures(input_features=out.numpy(), attention_mask=mask, peak=peak)


def feature_batch(
    clips: Sequence[np.ndarray],
    *,
    pad_to: int,
    truncate: bool,
    config: WhisperFeatureConfig = WhisperFeatureConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`log_mel_features` of every clip padded to ``pad_to`` samples, stacked as HF's
    extractor returns a ``padding="max_length"`` batch: ``input_features`` ``[clips, mels,
    frames]`` and its int32 ``attention_mask`` ``[clips, frames]``."""
    features = [
        log_mel_features(np.asarray(clip), pad_to=pad_to, truncate=truncate, config=config)
        for clip in clips
    ]
    return (
        torch.from_numpy(np.stack([f.input_features for f in features])),
        torch.from_numpy(np.stack([f.attention_mask for f in features])),
    )


def last_frame_in_longer_batch(
    audio: np.ndarray,
    alone: AudioFeatures,
    pad_to: Sequence[int],
    config: WhisperFeatureConfig = WhisperFeatureConfig(),
) -> list[np.ndarray | None]:
    """The features of the last frame of ``audio`` (a whole number of hops, whose features alone
    are ``alone``, from :func:`log_mel_features` with ``pad_to=None``) in a ``padding="longest"``
    batch that zero-pads it to each of ``pad_to`` samples (each at least a hop longer), or None
    where the batch changes more than that frame (the clamp's peak moves, or the clip is under
    :data:`FEW_FRAMES` frames): compute those batches whole.

    Only the last frame's window reaches past the clip (reflected alone, zeros in the batch); the
    batch's frames past the clip can raise the peak. Both are recomputed from the clip's last
    360 samples with the same STFT, projection and clamp as :func:`log_mel_features`; the alone
    frame recomputed this way must equal ``alone``'s, else every answer is None.
    """
    hop, half = config.hop_length, config.n_fft // 2
    length = audio.shape[0]
    frames = length // hop
    if length % hop or frames < FEW_FRAMES or any(p < length + hop or p % hop for p in pad_to):
        return [None] * len(pad_to)
    window, filters, silent = _constants(config)
    start = (frames - 1) * hop - half
    tail = np.ascontiguousarray(audio[start:], dtype=np.float32)
    reach = start + config.n_fft - length  # samples past the clip the last window needs
    # torch.stft's reflect padding mirrors the clip around its last sample
    alone_window = np.concatenate([tail, tail[-2 : -2 - reach : -1]])
    zero_padded = np.zeros(2 * hop + config.n_fft, dtype=np.float32)
    zero_padded[: tail.shape[0]] = tail
    # column 0: the last frame alone; 1-3: it and the next two in a batch (MKL's sgemm rounds
    # the same way only over enough columns: see log_mel_features)
    magnitudes = torch.zeros((1, filters.shape[1], _MIN_COLUMNS), dtype=torch.float32)
    for first, wave in ((0, alone_window), (1, zero_padded)):
        stft = torch.stft(
            torch.from_numpy(wave)[None], config.n_fft, hop, window=window, center=False,
            return_complex=True,
        )  # fmt: skip
        magnitudes[..., first : first + stft.shape[-1]] = stft.abs() ** 2
    log_spec = torch.clamp(filters @ magnitudes, min=1e-10).log10()[0]
    alone_last, zero_frames = log_spec[:, 0], log_spec[:, 1:4]
    floor = torch.tensor(alone.peak, dtype=torch.float32) - 8.0
    check = ((torch.maximum(alone_last, floor) + 4.0) / 4.0).numpy()
    if float(alone_last.max()) >= alone.peak or not np.array_equal(
        check, alone.input_features[:, frames - 1]
    ):
        # the peak may be the clip's last frame (the others' unknown), or the shortcut is off
        return [None] * len(pad_to)
    out: list[np.ndarray | None] = []
    for padded in pad_to:
        # the batch's frames past this clip: the next one, the one after, then silence
        beyond = padded // hop - frames
        peak = max(
            alone.peak,
            float(zero_frames[:, 0].max()),
            *(float(zero_frames[:, k].max()) for k in (1, 2) if beyond >= k),
            *((silent,) if beyond >= 3 else ()),
        )
        if peak != alone.peak:
            out.append(None)
            continue
        out.append(((torch.maximum(zero_frames[:, 0], floor) + 4.0) / 4.0).numpy())
    return out
