"""aiomm.media.video: streamed, sampled decode with PyAV; typed errors; the frame and byte
budget."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
from video_samples import CODECS, decode_all, frames_of, make_video

from aiomm.errors import DecodeError, EmptyVideoError, VideoTooLargeError
from aiomm.media.video import VideoInfo, decode_video, probe_video

FRAMES = frames_of(12, 64, 96)


@pytest.mark.parametrize(("codec", "fmt", "pix"), CODECS)
def test_probe_and_sampled_decode(codec: str, fmt: str, pix: str) -> None:
    data = make_video(FRAMES, codec, fmt, pix)
    info = probe_video(data)
    assert info == VideoInfo(12, 8.0, 64, 96)
    clip = decode_video(data, lambda i: [0, 4, 5, 11])
    assert clip.frames.shape == (4, 64, 96, 3)
    assert np.array_equal(clip.frames, decode_all(data)[[0, 4, 5, 11]])
    assert clip.frames_indices == (0, 4, 5, 11) and clip.fps == 8.0
    # a lossy codec still shows the frames it was given
    assert np.abs(clip.frames.astype(int) - FRAMES[[0, 4, 5, 11]]).mean() < 16


def test_variable_frame_rate_uses_the_average_rate() -> None:
    pts = [0, 100, 150, 400, 420, 500, 700, 800, 820, 900, 1000, 1200]
    data = make_video(FRAMES, pts=pts)
    with av.open(io.BytesIO(data)) as container:
        want = float(container.streams.video[0].average_rate)
    info = probe_video(data)
    assert info.total_num_frames == 12 and info.fps == pytest.approx(want) and info.fps != 8.0


def test_sampler_sees_the_header_and_decode_stops_early() -> None:
    seen = []
    data = make_video(FRAMES)
    clip = decode_video(data, lambda info: seen.append(info) or [1])
    assert seen == [VideoInfo(12, 8.0, 64, 96)]
    assert np.array_equal(clip.frames[0], decode_all(data)[1])


def _faststart(tmp_path: Path) -> bytes:
    """An MP4 whose index (and frame count) comes first, so a truncated copy still announces
    every frame."""
    path = tmp_path / "v.mp4"
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for array in FRAMES:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


def test_truncated_video(tmp_path: Path) -> None:
    data = _faststart(tmp_path)
    cut = data[: int(len(data) * 0.7)]
    assert probe_video(cut).total_num_frames == 12
    with pytest.raises(DecodeError, match="truncated video"):
        decode_video(cut, lambda i: range(i.total_num_frames))


def test_corrupt_and_empty_videos() -> None:
    with pytest.raises(DecodeError, match="not a decodable video"):
        probe_video(b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 300)
    with pytest.raises(DecodeError):
        probe_video(b"")
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:  # audio only
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")  # fmt: skip
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(EmptyVideoError, match="no video stream"):
        probe_video(buf.getvalue())


def test_budget_is_checked_before_decoding() -> None:
    data = make_video(FRAMES)
    everything = lambda i: range(i.total_num_frames)  # noqa: E731
    with pytest.raises(VideoTooLargeError, match="12 sampled frames exceed the limit of 8"):
        decode_video(data, everything, max_frames=8)
    with pytest.raises(VideoTooLargeError, match="bytes"):
        decode_video(data, everything, max_bytes=64 * 96 * 3 * 11)
    with pytest.raises(VideoTooLargeError, match="pixels"):
        decode_video(data, everything, max_pixels=64 * 95)
    assert (
        decode_video(data, everything, max_frames=12, max_bytes=64 * 96 * 3 * 12).frames.shape[0]
        == 12
    )
    with pytest.raises(DecodeError, match="must not decrease"):
        decode_video(data, lambda i: [3, 2])
    with pytest.raises(DecodeError, match="lie within"):
        decode_video(data, lambda i: [0, 12])
    with pytest.raises(EmptyVideoError):
        decode_video(data, lambda i: [])
