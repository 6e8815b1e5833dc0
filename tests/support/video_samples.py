"""Small videos made with PyAV for the video tests (a few frames, a few kilobytes)."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

from aiomm.media.video import VideoClip

#: (codec, container format, pixel format): the codecs the tests cover
CODECS = (
    ("mpeg4", "mp4", "yuv420p"),
    ("libvpx", "webm", "yuv420p"),  # no frame count in the header: packets are counted
    ("libx264", "matroska", "yuv444p"),  # 4:4:4 takes odd sizes
)


def frames_of(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``n`` smooth frames (gradients moving over time) that survive lossy codecs recognisably."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, 3)
    out = np.empty((n, height, width, 3), np.uint8)
    for t in range(n):
        for c in range(3):
            wave = np.sin((x + 3 * t) / (5 + c) + y / (7 + 2 * c) + base[c])
            out[t, :, :, c] = np.clip(base[c] * 0.5 + 60 * wave + 4 * t, 0, 255)
    return out


def noise_clip(rng: np.random.Generator, frames: int, height: int, width: int) -> VideoClip:
    """A clip of ``frames`` random frames, all of them sampled, at 30 fps (what a loader hands
    a processor)."""
    pixels = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    return VideoClip(pixels, 30.0, frames, tuple(range(frames)))


def make_video(
    frames: np.ndarray,
    codec: str = "mpeg4",
    fmt: str = "mp4",
    pix_fmt: str = "yuv420p",
    *,
    rate: int = 8,
    pts: list[int] | None = None,
) -> bytes:
    """Encode ``frames`` (``T x H x W x 3`` uint8). ``pts``: each frame's timestamp in
    milliseconds (a variable frame rate) instead of ``rate`` frames per second."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_all(data: bytes) -> np.ndarray:
    """Every frame of ``data`` as PyAV decodes it (the reference the sampled decode must match)."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
