"""How the engine turns an audio item into the waveform its adapter's features are made of.

Encoded bytes are decoded with :func:`aiomm.media.audio.decode_audio` (vLLM's loader and
resampler, sample for sample); samples given in memory as ``(samples, sampling_rate)`` are
averaged to mono and resampled the same way. Both run in worker threads (the hash stage's when
the :class:`~aiomm.engine.stages.Hasher` identifies decoded audio, else the transform stage's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aiomm.config import DecodeConfig
from aiomm.errors import (
    AudioTooLargeError,
    AudioTooLongError,
    EmptyAudioError,
    InvalidSourceError,
)
from aiomm.media.audio import DEFAULT_RESAMPLE_METHOD, decode_audio, resample_audio

__all__ = ("AudioLoader", "Waveform")


@dataclass(frozen=True)
class Waveform:
    """An audio item already loaded: mono float32 samples at the loader's rate (a caller's bare
    array is not one: its rate is unknown, so it is refused)."""

    samples: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.samples.nbytes)


@dataclass(frozen=True)
class AudioLoader:
    """Decodes and resamples audio to ``target_rate`` Hz within the :class:`DecodeConfig`'s
    audio limits; thread-safe (it holds only parameters)."""

    target_rate: int
    resample_method: str = DEFAULT_RESAMPLE_METHOD
    max_duration_s: float = 600.0
    max_encoded_bytes: int = 25 * 1024 * 1024
    max_decode_bytes: int = 268_435_456

    @classmethod
    def of(cls, config: DecodeConfig, target_rate: int, resample_method: str) -> AudioLoader:
        """The loader of ``config``'s limits for an adapter's rate and resampler."""
        return cls(
            target_rate,
            resample_method,
            max_duration_s=config.max_audio_duration_s,
            max_encoded_bytes=config.max_audio_bytes,
            max_decode_bytes=config.max_audio_decode_bytes,
        )

    def load(self, raw: Any) -> np.ndarray:
        """The mono float32 waveform at :attr:`target_rate` of encoded bytes, a ``(samples,
        rate)`` tuple, or a :class:`Waveform` already loaded.

        :raises AudioDecodeError, AudioTooLargeError, AudioTooLongError, EmptyAudioError: see
            :func:`aiomm.media.audio.decode_audio`.
        :raises InvalidSourceError: an in-memory item that is not ``(samples, rate)``.
        """
        if isinstance(raw, Waveform):
            return raw.samples
        if isinstance(raw, (bytes, bytearray, memoryview)):
            return decode_audio(
                bytes(raw),
                target_rate=self.target_rate,
                resample_method=self.resample_method,
                max_duration_s=self.max_duration_s,
                max_decode_bytes=self.max_decode_bytes,
                max_encoded_bytes=self.max_encoded_bytes,
            )
        return self.from_memory(raw)

    def from_memory(self, item: Any) -> np.ndarray:
        """A ``(samples, rate)`` tuple as a mono float32 waveform at :attr:`target_rate`:
        ``channels x time`` samples are averaged over the channels, as decoded audio is.

        :raises InvalidSourceError: not a pair of a 1-D or 2-D real array and a positive rate.
        :raises EmptyAudioError: no sample.
        :raises AudioTooLongError, AudioDecodeError: see :func:`resample_audio` and the limits.
        """
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidSourceError(
                f"an audio in memory is a (samples, sampling_rate) tuple, got a "
                f"{type(item).__name__}"
            )
        samples, rate = item
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer)) or rate <= 0:
            raise InvalidSourceError(f"an audio's sampling rate must be positive, got {rate!r}")
        array = np.asarray(samples)
        if array.ndim not in (1, 2) or not (
            np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
        ):
            raise InvalidSourceError(
                f"audio samples must be a 1-D or channels x time real array, got "
                f"{array.dtype} {array.shape}"
            )
        if array.size == 0:
            raise EmptyAudioError("the audio holds no sample")
        if array.shape[-1] / float(rate) > self.max_duration_s:
            raise AudioTooLongError(f"{array.shape[-1]} samples at {rate} Hz", self.max_duration_s)
        if array.size * 4 > self.max_decode_bytes:
            raise AudioTooLargeError("audio samples", array.size * 4, self.max_decode_bytes)
        audio = array.astype(np.float32, copy=False)
        if audio.ndim == 2:
            audio = np.mean(audio, axis=0)
        return resample_audio(
            np.ascontiguousarray(audio),
            orig_rate=float(rate),
            target_rate=self.target_rate,
            method=self.resample_method,
        )
