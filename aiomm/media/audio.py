"""Audio bytes to a mono float32 waveform at a model's sampling rate, sample for sample what
vLLM 0.33's render server hands the HF processor for the same bytes with ``vllm[audio]``
installed.

vLLM's path has two steps, both mirrored here with the same libraries:

1. ``AudioMediaIO.load_bytes`` → ``load_audio(sr=None, backend="auto")`` decodes at the native
   rate. "auto" tries torchcodec (which ``vllm[audio]`` does not install), then libsndfile
   through soundfile (WAV, FLAC, MP3, Ogg Vorbis/Opus, AIFF, ...), then PyAV only when
   libsndfile does not recognise the bytes (its error codes 0, 1, 3, 4: M4A/AAC, WebM, MP4, ...).
   Several channels are averaged with ``np.mean`` over the channel axis.
2. The model's data parser resamples to the feature extractor's rate with
   ``AudioResampler(method="torchaudio")``, the default every Qwen audio model keeps:
   ``torchaudio.transforms.Resample`` (windowed-sinc, Hann, width 6, roll-off 0.99) run with
   oneDNN disabled. torchaudio pins one torch release, so its kernel is rebuilt here with the
   same torch ops and applied with the convolution op that path dispatches to
   (``aten._slow_conv2d_forward``), which needs no process-wide flag.
   ``resample_method`` also takes vLLM's other methods ("pyav", "scipy", "soxr").

The limits are vLLM's defaults (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``,
``VLLM_MAX_AUDIO_DECODE_DURATION_S``, ``VLLM_MAX_AUDIO_DECODE_BYTES``), checked where vLLM checks
them. Where vLLM returns audio of zero samples, aiomm raises :class:`~aiomm.errors.EmptyAudioError`;
where a rate pair would need a sinc kernel above ``_MAX_KERNEL_ELEMENTS`` (an odd rate such as
44101 Hz, which vLLM would try to build), :class:`~aiomm.errors.AudioDecodeError`.

Synchronous; runs in a worker thread: libsndfile, FFmpeg and torch's convolution run without
the GIL (libsndfile calls back into Python only to read the in-memory buffer).
"""

from __future__ import annotations

import functools
import importlib
import io
import math
from typing import Any

import numpy as np
import torch

from aiomm.errors import (
    AudioDecodeError,
    AudioTooLargeError,
    AudioTooLongError,
    DecodeError,
    EmptyAudioError,
)

__all__ = (
    "DEFAULT_MAX_DECODE_BYTES",
    "DEFAULT_MAX_DURATION_S",
    "DEFAULT_MAX_ENCODED_BYTES",
    "DEFAULT_RESAMPLE_METHOD",
    "RESAMPLE_METHODS",
    "decode_audio",
    "load_audio",
    "resample_audio",
)

#: ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` (25 MiB of encoded bytes)
DEFAULT_MAX_ENCODED_BYTES = 25 * 1024 * 1024
#: ``VLLM_MAX_AUDIO_DECODE_DURATION_S``
DEFAULT_MAX_DURATION_S = 600.0
#: ``VLLM_MAX_AUDIO_DECODE_BYTES`` (256 MiB of decoded PCM)
DEFAULT_MAX_DECODE_BYTES = 268_435_456
#: vLLM's ``AudioResampler`` methods
RESAMPLE_METHODS = ("torchaudio", "pyav", "scipy", "soxr")
#: what ``MultiModalDataParser`` uses unless a model overrides it (no Qwen audio model does)
DEFAULT_RESAMPLE_METHOD = "torchaudio"

#: the largest torchaudio-style resampling kernel built (128 MiB as float64; 44056 Hz needs 11M)
_MAX_KERNEL_ELEMENTS = 1 << 24

# libsndfile's codes for "not a format I know" (0 is its error-reporting race): vLLM then tries
# PyAV; any other libsndfile error is final
_UNRECOGNISED_SF_CODES = frozenset({0, 1, 3, 4})


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - the audio extra is installed in CI
        raise AudioDecodeError(f"decoding audio needs {name}: pip install 'aiomm[audio]'") from exc


def decode_audio(
    data: bytes,
    *,
    target_rate: int,
    resample_method: str = DEFAULT_RESAMPLE_METHOD,
    max_duration_s: float = DEFAULT_MAX_DURATION_S,
    max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
    max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES,
) -> np.ndarray:
    """``data`` decoded, averaged to mono and resampled to ``target_rate`` Hz, as vLLM's render
    server does it (float32).

    :raises AudioTooLargeError: ``data`` or its decoded PCM above the byte limits.
    :raises AudioTooLongError: longer than ``max_duration_s``.
    :raises EmptyAudioError: no audio stream, or no sample.
    :raises AudioDecodeError: bytes that neither libsndfile nor FFmpeg decode.
    """
    audio, rate = load_audio(
        data,
        max_duration_s=max_duration_s,
        max_decode_bytes=max_decode_bytes,
        max_encoded_bytes=max_encoded_bytes,
    )
    return resample_audio(audio, orig_rate=rate, target_rate=target_rate, method=resample_method)


def load_audio(
    data: bytes,
    *,
    max_duration_s: float = DEFAULT_MAX_DURATION_S,
    max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
    max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES,
) -> tuple[np.ndarray, float]:
    """``data`` decoded at its native rate and averaged to mono: ``(waveform, rate)``.

    Raises as :func:`decode_audio`.
    """
    if len(data) > max_encoded_bytes:
        raise AudioTooLargeError("encoded audio", len(data), max_encoded_bytes)
    if not data:
        raise EmptyAudioError("empty audio: zero bytes")
    soundfile = _import("soundfile")
    try:
        try:
            audio, rate = _load_soundfile(
                soundfile, data, max_duration_s=max_duration_s, max_decode_bytes=max_decode_bytes
            )
        except soundfile.LibsndfileError as exc:
            if exc.code not in _UNRECOGNISED_SF_CODES:
                raise AudioDecodeError(
                    f"corrupt audio ({len(data)} bytes): {exc.error_string}"
                ) from exc
            audio, rate = _load_pyav(
                data, max_duration_s=max_duration_s, max_decode_bytes=max_decode_bytes
            )
    except DecodeError:
        raise
    except (
        RuntimeError,
        ValueError,
        TypeError,
        OSError,
        ArithmeticError,
        AttributeError,
        LookupError,
    ) as exc:
        # whatever else a hostile header provokes in soundfile or PyAV
        raise AudioDecodeError(f"corrupt audio ({len(data)} bytes): {exc}") from exc
    if audio.size == 0:
        raise EmptyAudioError("the audio holds no sample")
    return audio, rate


def _load_soundfile(
    soundfile: Any, data: bytes, *, max_duration_s: float, max_decode_bytes: int
) -> tuple[np.ndarray, float]:
    """vLLM's ``load_audio_soundfile(sr=None)``."""
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        native_sr = f.samplerate
        duration_s = f.frames / native_sr
        if duration_s > max_duration_s:
            raise AudioTooLongError(f"{duration_s:.1f} s at {native_sr} Hz", max_duration_s)
        estimated = f.frames * f.channels * np.dtype(np.float32).itemsize
        if estimated > max_decode_bytes:
            raise AudioTooLargeError(
                f"decoded PCM ({f.frames} frames x {f.channels} channels x 4 B)",
                estimated,
                max_decode_bytes,
            )
        y = f.read(dtype="float32", always_2d=False).T
    if y.ndim > 1:
        y = np.mean(y, axis=tuple(range(y.ndim - 1)))
    return y, native_sr


def _load_pyav(
    data: bytes, *, max_duration_s: float, max_decode_bytes: int
) -> tuple[np.ndarray, float]:
    """vLLM's ``load_audio_pyav(sr=None)``: native rate, so its resampler never runs."""
    av = _import("av")
    try:
        container = av.open(io.BytesIO(data))
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise AudioDecodeError(f"not decodable audio ({len(data)} bytes): {exc}") from exc
    with container:
        if not container.streams.audio:
            raise EmptyAudioError(f"the container ({container.format.name}) has no audio stream")
        stream = container.streams.audio[0]
        stream.thread_type = "AUTO"
        native_sr = stream.rate
        header_s = None
        if stream.duration and stream.time_base:
            header_s = float(stream.duration * stream.time_base)
        elif container.duration:
            header_s = container.duration / 1_000_000
        if header_s is not None and header_s > max_duration_s:
            raise AudioTooLongError(f"the header says {header_s:.1f} s", max_duration_s)
        max_samples = int(native_sr * max_duration_s)
        total_samples = 0
        total_bytes = 0
        chunks: list[np.ndarray] = []
        try:
            for frame in container.decode(stream):
                arr = frame.to_ndarray()
                total_samples += arr.shape[-1]
                total_bytes += arr.nbytes
                chunks.append(arr)
                if total_samples > max_samples:
                    raise AudioTooLongError(
                        f"decoded {total_samples} samples at {native_sr} Hz", max_duration_s
                    )
                if total_bytes > max_decode_bytes:
                    raise AudioTooLargeError("decoded PCM", total_bytes, max_decode_bytes)
        except av.FFmpegError as exc:
            raise AudioDecodeError(f"corrupt audio ({len(data)} bytes): {exc}") from exc
    if not chunks:
        raise EmptyAudioError("the audio stream decoded to no frame")
    # vLLM keeps the decoder's sample format's values (int16 stays in +-32768) and averages the
    # first axis, also of a packed layout's single row
    audio = np.concatenate(chunks, axis=-1).astype(np.float32)
    if audio.ndim > 1:
        audio = np.mean(audio, axis=0)
    return audio, native_sr


def resample_audio(
    audio: np.ndarray,
    *,
    orig_rate: float,
    target_rate: float,
    method: str = DEFAULT_RESAMPLE_METHOD,
) -> np.ndarray:
    """vLLM's ``AudioResampler(target_rate, method).resample(audio, orig_sr=orig_rate)``.

    :raises AudioDecodeError: an unknown method, its library is not installed, or (torchaudio)
        a rate pair whose kernel would exceed ``_MAX_KERNEL_ELEMENTS`` (vLLM would build it).
    """
    if method not in RESAMPLE_METHODS:
        raise AudioDecodeError(f"unknown resampling method {method!r}; one of {RESAMPLE_METHODS}")
    if math.isclose(float(orig_rate), float(target_rate), rel_tol=0.0, abs_tol=1e-6):
        return audio
    orig, target = round(orig_rate), round(target_rate)
    if orig == target:
        return audio
    if method == "torchaudio":
        _check_kernel_size(orig, target)
        return _resample_sinc(torch.as_tensor(audio, dtype=torch.float32), orig, target).numpy()
    if method == "pyav":
        return _resample_pyav(audio, orig, target)
    if method == "scipy":
        gcd = math.gcd(orig, target)
        signal = _import("scipy.signal")
        return np.asarray(signal.resample_poly(audio, target // gcd, orig // gcd, axis=-1))
    return np.asarray(_import("soxr").resample(audio, orig, target))


def _kernel_shape(orig: int, target: int) -> tuple[int, int]:
    """``(rows, taps)`` of the sinc kernel for ``orig`` → ``target`` Hz."""
    gcd = math.gcd(orig, target)
    o, t = orig // gcd, target // gcd
    width = math.ceil(6 * o / (min(o, t) * 0.99))
    return t, 2 * width + o


def _check_kernel_size(orig: int, target: int) -> None:
    """Refuse rates whose gcd-reduced ratio needs a kernel above ``_MAX_KERNEL_ELEMENTS``: a
    header claiming 44101 Hz would build a 16000 x 44135 float64 kernel (torchaudio, and so
    vLLM, would try). Every common rate stays far below (44.1 kHz: 160 x 475)."""
    rows, taps = _kernel_shape(orig, target)
    if rows * taps > _MAX_KERNEL_ELEMENTS:
        raise AudioDecodeError(
            f"resampling {orig} Hz to {target} Hz needs a {rows} x {taps} sinc kernel, "
            f"above the limit of {_MAX_KERNEL_ELEMENTS} coefficients"
        )


def _sinc_kernel(orig: int, target: int) -> tuple[torch.Tensor, int]:
    """torchaudio 2.11's ``_get_sinc_resample_kernel`` with ``Resample``'s defaults
    (``sinc_interp_hann``, ``lowpass_filter_width=6``, ``rolloff=0.99``, float64 then float32),
    op for op: ``(kernel (new, 1, taps), width)`` for the gcd-reduced rates."""
    gcd = math.gcd(orig, target)
    orig, target = orig // gcd, target // gcd
    lowpass_filter_width = 6
    base_freq = min(orig, target) * 0.99
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    # int64 / int → float32 (torch's default dtype, as in torchaudio), then float64 with idx
    t = torch.arange(0, -target, -1)[:, None, None] / target + idx
    t *= base_freq
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    scale = base_freq / orig
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    return kernels.to(dtype=torch.float32), width


#: the kernels of the common rates, kept (an odd rate's large kernel is rebuilt, not kept)
_cached_sinc_kernel = functools.lru_cache(maxsize=32)(_sinc_kernel)
_CACHED_KERNEL_ELEMENTS = 1 << 20


def _resample_sinc(waveform: torch.Tensor, orig: int, target: int) -> torch.Tensor:
    """torchaudio's ``_apply_sinc_resample_kernel`` on a 1-D float32 waveform. vLLM runs it
    with oneDNN off, where ``conv1d`` lowers to ``_slow_conv2d_forward`` (im2col + MKL sgemm);
    calling that op directly gives the same bits (oneDNN's convolution rounds differently)."""
    rows, taps = _kernel_shape(orig, target)
    small = rows * taps <= _CACHED_KERNEL_ELEMENTS
    kernel, width = (_cached_sinc_kernel if small else _sinc_kernel)(orig, target)
    gcd = math.gcd(orig, target)
    orig, target = orig // gcd, target // gcd
    length = waveform.shape[-1]
    padded = torch.nn.functional.pad(waveform.reshape(1, -1), (width, width + orig))
    out = torch.ops.aten._slow_conv2d_forward(
        padded[:, None, None, :], kernel[:, :, None, :], [1, taps], None, [1, orig], [0, 0]
    )
    resampled = out.reshape(1, target, -1).transpose(1, 2).reshape(-1)
    # torchaudio takes the ceiling of the float32 length, which rounds for long clips
    kept = int(torch.ceil(torch.as_tensor(target * length / orig)))
    return resampled[:kept]


def _resample_pyav(audio: np.ndarray, orig: int, target: int) -> np.ndarray:
    """vLLM's ``resample_audio_pyav`` (libswresample) on a 1-D waveform."""
    av = _import("av")
    expected = math.ceil(audio.shape[-1] * target / orig)
    samples = np.asarray(audio, dtype=np.float32)
    if len(samples) < 1024:
        # libswresample needs enough input to produce a frame
        samples = np.pad(samples, (0, 1024 - len(samples)))
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=target)
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="fltp", layout="mono")
    frame.sample_rate = orig
    out = resampler.resample(frame)
    out.extend(resampler.resample(None))
    result: np.ndarray = np.concatenate([f.to_ndarray() for f in out], axis=1).squeeze(0)
    return result[:expected]
