"""Short synthetic clips encoded in the containers the audio tests cover (soundfile for WAV,
FLAC, MP3 and Ogg; PyAV for M4A/AAC and WebM/Opus, which libsndfile does not read).

Shared by ``tests/media/test_audio.py`` and ``tests/media/record_audio_fixtures.py`` (run with
vLLM's interpreter), so both encode the same signals the same way.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AudioCase:
    """One clip: ``fmt`` is a soundfile format ("WAV", "FLAC", "MP3", "OGG") or a PyAV container
    ("mp4", "webm") with ``subtype`` its codec."""

    name: str
    fmt: str
    subtype: str
    rate: int
    channels: int
    seconds: float = 0.25

    @property
    def lossless_pcm(self) -> bool:
        """PCM WAV bytes depend on nothing but the samples (a float WAV's PEAK chunk holds a
        timestamp): the fixture need not keep them."""
        return self.fmt == "WAV" and self.subtype.startswith("PCM")


CASES = (
    AudioCase("wav_8k_mono_pcm16", "WAV", "PCM_16", 8000, 1),
    AudioCase("wav_16k_mono_pcm16", "WAV", "PCM_16", 16000, 1),
    AudioCase("wav_16k_stereo_float", "WAV", "FLOAT", 16000, 2),
    AudioCase("wav_22050_mono_float", "WAV", "FLOAT", 22050, 1),
    AudioCase("wav_44100_stereo_pcm16", "WAV", "PCM_16", 44100, 2),
    AudioCase("wav_44100_mono_pcm16_long", "WAV", "PCM_16", 44100, 1, seconds=3.7),
    AudioCase("wav_48k_stereo_pcm24", "WAV", "PCM_24", 48000, 2),
    AudioCase("wav_11025_mono_u8", "WAV", "PCM_U8", 11025, 1),
    AudioCase("flac_44100_stereo", "FLAC", "PCM_16", 44100, 2),
    AudioCase("flac_16k_mono", "FLAC", "PCM_24", 16000, 1),
    AudioCase("mp3_44100_stereo", "MP3", "MPEG_LAYER_III", 44100, 2),
    AudioCase("mp3_22050_mono", "MP3", "MPEG_LAYER_III", 22050, 1),
    AudioCase("ogg_vorbis_48k_stereo", "OGG", "VORBIS", 48000, 2),
    AudioCase("ogg_vorbis_16k_mono", "OGG", "VORBIS", 16000, 1),
    AudioCase("ogg_opus_48k_mono", "OGG", "OPUS", 48000, 1),
    AudioCase("m4a_aac_44100_stereo", "mp4", "aac", 44100, 2),
    AudioCase("webm_opus_48k_stereo", "webm", "libopus", 48000, 2),
)


def signal(rate: int, channels: int, seconds: float, seed: int = 0) -> np.ndarray:
    """``(samples, channels)`` float32: a chirp and a tone per channel under a little noise,
    peaking near 0.8 (lossy codecs keep it recognisable; no sample clips)."""
    n = round(rate * seconds)
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    out = np.empty((n, channels), np.float32)
    for c in range(channels):
        chirp = np.sin(2 * np.pi * (200 + 300 * c) * t + 2 * np.pi * 900 * t**2)
        tone = 0.3 * np.sin(2 * np.pi * (440 * (c + 1)) * t)
        out[:, c] = 0.5 * chirp + tone + 0.02 * rng.standard_normal(n)
    return out


def encode(case: AudioCase, samples: np.ndarray | None = None) -> bytes:
    """``case``'s clip (or ``samples``, ``(n, channels)``) encoded as the case says."""
    if samples is None:
        samples = signal(case.rate, case.channels, case.seconds)
    if case.fmt in ("WAV", "FLAC", "MP3", "OGG"):
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, samples, case.rate, format=case.fmt, subtype=case.subtype)
        return buf.getvalue()
    return _encode_pyav(case, samples)


def _encode_pyav(case: AudioCase, samples: np.ndarray) -> bytes:
    import av

    buf = io.BytesIO()
    layout = "mono" if case.channels == 1 else "stereo"
    with av.open(buf, mode="w", format=case.fmt) as container:
        stream = container.add_stream(case.subtype, rate=case.rate, layout=layout)
        fmt = stream.codec_context.format.name
        planar = np.ascontiguousarray(samples.T, dtype=np.float32)
        step = 1024
        for start in range(0, planar.shape[1], step):
            chunk = planar[:, start : start + step]
            if fmt.startswith("s16"):
                chunk = np.round(chunk * 32767).astype(np.int16)
            if not fmt.endswith("p"):  # packed: one row of interleaved samples
                chunk = chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(chunk), format=fmt, layout=layout
            )
            frame.sample_rate = case.rate
            frame.pts = start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()
