"""Audio preprocessing, aiomm against HF's WhisperFeatureExtractor, side by side in one run.

Two comparisons, on the same clips (synthetic speech-like audio, ``--seconds`` long, encoded as
``--format`` at ``--rate`` Hz with ``--channels`` channels):

* features: 16 kHz float32 waveforms to Qwen2-Audio's log-mel features (128 mels, padded to
  30 s with the attention mask): ``WhisperFeatureExtractor.__call__`` against
  ``aiomm.processing.audio_features.log_mel_features``;
* decode + resample + features: the bytes to features. The reference decodes as vLLM's render
  server does (soundfile, channels averaged, torchaudio's sinc kernel applied by ``conv1d`` with
  oneDNN off) and calls HF; aiomm runs ``decode_audio`` then ``log_mel_features``.

Each path's output is checked equal to the reference's first. Prints CPU milliseconds per second
of audio (one thread) and clips per second on ``--threads`` worker threads, and aiomm's ratios.

    python bench/audio_bench.py [--seconds 2 5 10 30] [--format WAV] [--rate 44100]
                                [--channels 2] [--clips 16] [--threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import soundfile
import torch
from transformers import WhisperFeatureExtractor

from aiomm.media.audio import _sinc_kernel, decode_audio
from aiomm.processing.audio_features import log_mel_features

RATE = 16000


def make_clip(seconds: float, rate: int, channels: int, fmt: str, seed: int = 0) -> bytes:
    """A speech-like clip (syllable-rate amplitude modulation of a few harmonics, some noise)."""
    n = round(seconds * rate)
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    out = np.empty((n, channels), np.float32)
    for c in range(channels):
        voice = sum(np.sin(2 * np.pi * (140 + 5 * c) * k * t) / k for k in range(1, 6))
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + c)
        out[:, c] = 0.3 * voice * envelope + 0.01 * rng.standard_normal(n)
    buf = io.BytesIO()
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "MP3": "MPEG_LAYER_III", "OGG": "VORBIS"}[fmt]
    soundfile.write(buf, out, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def hf_extractor() -> WhisperFeatureExtractor:
    """The Qwen2-Audio checkpoint's documented feature extractor."""
    return WhisperFeatureExtractor(
        feature_size=128, sampling_rate=RATE, hop_length=160, chunk_length=30, n_fft=400,
        padding_value=0.0, return_attention_mask=True,
    )  # fmt: skip


def vllm_decode(data: bytes) -> np.ndarray:
    """vLLM's render path: ``load_audio_soundfile`` then ``resample_audio_torchaudio`` (the
    kernel torchaudio builds, applied by ``conv1d`` with oneDNN off as vLLM runs it)."""
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        rate = f.samplerate
        y = f.read(dtype="float32", always_2d=False).T
    if y.ndim > 1:
        y = np.mean(y, axis=0)
    if rate == RATE:
        return np.asarray(y)
    kernel, width = _sinc_kernel(rate, RATE)
    gcd = math.gcd(rate, RATE)
    orig, new = rate // gcd, RATE // gcd
    wave = torch.nn.functional.pad(torch.from_numpy(y)[None], (width, width + orig))
    # vLLM's `mkldnn.flags(enabled=False)`, without its TF32 warning; process-wide, as in vLLM
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    try:
        out = torch.nn.functional.conv1d(wave[:, None], kernel, stride=orig)
    finally:
        torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
    out = out.transpose(1, 2).reshape(1, -1)
    kept = int(torch.ceil(torch.as_tensor(new * y.shape[-1] / orig)))
    return out[0, :kept].numpy()


def _hf_features(hf: WhisperFeatureExtractor, wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = hf(wave, sampling_rate=RATE, return_attention_mask=True, padding="max_length")
    return out["input_features"][0], out["attention_mask"][0]


def _aiomm_features(wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = log_mel_features(wave)
    return out.input_features, out.attention_mask


def _measure(
    fn: Callable[[Any], object], inputs: Sequence[Any], repeat: int, threads: int
) -> tuple[float, float]:
    """(CPU seconds over ``repeat`` serial passes, clips per second on ``threads`` threads)."""
    for item in inputs[: min(2, len(inputs))]:
        fn(item)  # warm caches (mel filters, resampling kernels)
    cpu = time.process_time()
    for _ in range(repeat):
        for item in inputs:
            fn(item)
    cpu = time.process_time() - cpu
    work = list(inputs) * repeat
    with ThreadPoolExecutor(threads) as pool:
        wall = time.perf_counter()
        list(pool.map(fn, work))
        wall = time.perf_counter() - wall
    return cpu, len(work) / wall


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[2.0, 5.0, 10.0, 30.0])
    parser.add_argument("--format", default="WAV", choices=("WAV", "FLAC", "MP3", "OGG"))
    parser.add_argument("--rate", type=int, default=44100)
    parser.add_argument("--channels", type=int, default=2)
    parser.add_argument("--clips", type=int, default=16, help="clips per duration")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny run for the test")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.clips, args.repeat = [0.5, 31.0], 1, 1
    torch.set_num_threads(1)  # one intra-op thread per worker, as aiomm's workers run

    clips = [
        make_clip(s, args.rate, args.channels, args.format, seed=i)
        for s in args.seconds
        for i in range(args.clips)
    ]
    audio_seconds = args.clips * sum(args.seconds)
    waves = [vllm_decode(c) for c in clips]
    hf = hf_extractor()

    # equal outputs first: aiomm's decode to vLLM's, aiomm's features to HF's
    for data, wave in zip(clips, waves, strict=True):
        np.testing.assert_array_equal(decode_audio(data, target_rate=RATE), wave)
        for a, b in zip(_aiomm_features(wave), _hf_features(hf, wave), strict=True):
            np.testing.assert_array_equal(a, b)

    paths: dict[str, tuple[Callable[[Any], object], Sequence[Any]]] = {
        "features hf": (lambda w: _hf_features(hf, w), waves),
        "features aiomm": (_aiomm_features, waves),
        "decode+features vllm/hf": (lambda d: _hf_features(hf, vllm_decode(d)), clips),
        "decode+features aiomm": (
            lambda d: _aiomm_features(decode_audio(d, target_rate=RATE)),
            clips,
        ),
    }
    report: dict[str, Any] = {"audio_seconds": audio_seconds, "clips": len(clips)}
    for name, (fn, inputs) in paths.items():
        cpu, clips_per_s = _measure(fn, inputs, args.repeat, args.threads)
        report[name] = {
            "cpu_ms_per_audio_s": 1000 * cpu / (audio_seconds * args.repeat),
            "clips_per_s": clips_per_s,
        }

    print(
        f"{len(clips)} clips ({', '.join(f'{s:g}' for s in args.seconds)} s; {args.format} "
        f"{args.rate} Hz x{args.channels}), {args.threads} threads, torch threads 1"
    )
    print(f"{'path':<26}{'CPU ms / audio s':>18}{f'clips/s ({args.threads} thr)':>20}")
    for name in paths:
        row = report[name]
        print(f"{name:<26}{row['cpu_ms_per_audio_s']:>18.3f}{row['clips_per_s']:>20.1f}")
    for ours, theirs in (
        ("features aiomm", "features hf"),
        ("decode+features aiomm", "decode+features vllm/hf"),
    ):
        cpu = report[theirs]["cpu_ms_per_audio_s"] / report[ours]["cpu_ms_per_audio_s"]
        rate = report[ours]["clips_per_s"] / report[theirs]["clips_per_s"]
        report[f"{ours} speed vs hf"] = {"cpu": cpu, "clips_per_s": rate}
        print(f"{ours} speed vs hf: {cpu:.2f}x less CPU, {rate:.2f}x clips/s")
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
