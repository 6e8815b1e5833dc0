"""The server's video rule against OpenCV, the codec vLLM 0.33's render server decodes with.

vLLM reads a ``video_url`` with OpenCV's FFmpeg capture (``VLLM_VIDEO_LOADER_BACKEND=opencv``):
the header's frame count and rate, then ``grab``/``retrieve`` in stream order and BGR->RGB. Here
that path is replayed with OpenCV itself (as ``vllm/multimodal/video_decoders/opencv.py`` does it)
on clips made with PyAV, and aiomm's PyAV probe and decode must give the same header, indices
and frames, byte for byte.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest

av = pytest.importorskip("av")
cv2 = pytest.importorskip("cv2")

from aiomm.errors import DecodeError, EmptyVideoError  # noqa: E402
from aiomm.media.video import decode_video  # noqa: E402
from aiomm.vllm.video_media import (  # noqa: E402
    hash_metadata,
    probe_video_vllm,
    sample_indices,
    sample_indices_glm4v,
    sample_indices_glm46v,
    sample_indices_qwen3,
    video_loader,
)


def _clip(
    codec: str,
    fmt: str,
    size: tuple[int, int],
    frames: int,
    fps: int | Fraction,
    pix: str,
    tags: tuple[int, int] | None = None,
    vfr: bool = False,
) -> bytes:
    width, height = size
    rng = np.random.default_rng(frames * 7 + width)
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix
        if tags is not None:  # (colour space, range) tags, e.g. BT.709 full range
            stream.codec_context.colorspace, stream.codec_context.color_range = tags
        if vfr:
            stream.codec_context.time_base = Fraction(1, 1000)
        pts = 0
        for i in range(frames):
            rgb = np.stack([(x * 3 + 9 * i) % 256, (y * 4 + 5 * i) % 256, (x + y) % 256], axis=-1)
            rgb = np.clip(rgb + rng.normal(0, 10, rgb.shape), 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if vfr:  # frames 33, 66 or 100 ms apart
                frame.pts, frame.time_base = pts, Fraction(1, 1000)
                pts += int(rng.choice([33, 66, 100]))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


CLIPS = {
    "h264_420": ("libx264", "mp4", (78, 46), 14, 7, "yuv420p"),
    "h264_444_odd": ("libx264", "mp4", (77, 45), 23, 9, "yuv444p"),
    "vp9_webm": ("libvpx-vp9", "webm", (64, 40), 16, 8, "yuv420p"),
    "vp8_webm": ("libvpx", "webm", (50, 66), 25, 5, "yuv420p"),
    "mpeg4": ("mpeg4", "mp4", (70, 50), 40, 12, "yuv420p"),
    "mjpeg_avi": ("mjpeg", "avi", (60, 44), 9, 4, "yuvj420p"),
    # tagged BT.709, full range: both decoders convert with swscale's defaults alike
    "h264_bt709_full": ("libx264", "mp4", (64, 48), 16, 8, "yuv420p", (1, 2)),
    # variable frame rates: the header's count (or the duration's estimate) is not the frames
    # there, and vLLM takes OpenCV's end-of-stream position instead
    "vfr_h264_mkv": (
        "libx264",
        "matroska",
        (28, 50),
        77,
        Fraction(30000, 1001),
        "yuv420p",
        None,
        True,
    ),
    "vfr_mpeg4_mp4": ("mpeg4", "mp4", (80, 102), 82, Fraction(30000, 1001), "yuv420p", None, True),
    "vfr_vp8_webm": ("libvpx", "webm", (24, 102), 11, 112, "yuv420p", None, True),
}


def _opencv_capture(data: bytes, params: list[int]) -> tuple[object, io.BytesIO]:
    api = None
    registry = cv2.videoio_registry
    for backend in registry.getStreamBufferedBackends():
        if registry.hasBackend(backend):
            api = backend
            break
    buf = io.BytesIO(data)  # must outlive the capture
    return cv2.VideoCapture(buf, api, params), buf


def _opencv_read(data: bytes, sample: object) -> tuple[int, float, list[int], np.ndarray]:
    """vLLM's OpenCV path (``get_video_metadata``, then ``_read_frames_no_recovery``): (frame
    count, fps, the indices read, RGB frames)."""
    cap, _buf = _opencv_capture(data, [])
    assert cap.isOpened()
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    fps = cap.get(cv2.CAP_PROP_FPS)
    if total <= 0:
        demux, _b = _opencv_capture(data, [cv2.CAP_PROP_FORMAT, -1])
        while demux.grab():
            total += 1
        demux.release()
    elif cap.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
        visible = int(cap.get(cv2.CAP_PROP_POS_FRAMES))
        if not cap.grab() and 0 < visible < total - 1:
            total = visible
    cap.release()
    from aiomm.media.video import VideoInfo

    indices = sample(VideoInfo(total, fps, 1, 1))  # type: ignore[operator]
    cap, _buf = _opencv_capture(data, [])
    wanted, frames, read = set(indices), [], []
    for idx in range(max(indices) + 1):
        if not cap.grab():
            continue  # vLLM skips frames it cannot grab
        if idx in wanted:
            ok, frame = cap.retrieve()
            assert ok
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            read.append(idx)
    cap.release()
    return total, fps, read, np.stack(frames)


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_header_indices_and_frames_equal_opencv(name: str) -> None:
    data = _clip(*CLIPS[name])
    total, fps, cv_indices, cv_frames = _opencv_read(data, sample_indices)
    info = probe_video_vllm(data)
    assert (info.total_num_frames, info.fps) == (total, fps)
    indices = sample_indices(info)
    assert indices == cv_indices
    clip = decode_video(data, lambda _: indices, info=info)
    assert clip.frames.shape == cv_frames.shape
    assert np.array_equal(clip.frames, cv_frames)  # PyAV's swscale RGB == OpenCV's BGR, flipped


def test_sampling_and_metadata_follow_vllm_qwen2_loader() -> None:
    from aiomm.media.video import VideoInfo

    # 2 fps, at least 4 frames, a multiple of the temporal patch, never more than the video has
    assert sample_indices(VideoInfo(20, 10.0, 8, 8)) == [0, 5, 10, 15]
    assert sample_indices(VideoInfo(300, 30.0, 8, 8)) == list(range(0, 300, 15))
    assert sample_indices(VideoInfo(5, 30.0, 8, 8)) == [0, 1, 2, 3]
    assert len(sample_indices(VideoInfo(100_000, 25.0, 8, 8))) == 768
    # float32 steps give 15 indices for n = 14, the last one past the end: read as the last frame
    odd = sample_indices(VideoInfo(34, 4.5, 8, 8))
    assert len(odd) == 15 and odd[-2:] == [31, 33]
    meta = hash_metadata(VideoInfo(20, 10.0, 8, 8), [0, 5, 10, 15])
    assert meta == {
        "total_num_frames": 20,
        "fps": 10.0,
        "duration": 2.0,
        "video_backend": "opencv",
        "frames_indices": [0, 5, 10, 15],
        "do_sample_frames": False,
    }
    with pytest.raises(DecodeError, match="too short"):
        sample_indices(VideoInfo(1, 30.0, 8, 8))


def test_sampling_follows_vllm_qwen3_loader() -> None:
    from aiomm.media.video import VideoInfo

    # int(total / fps * 2) frames within [4, min(768, total)], rounded linspace: first and last
    # included, no multiple of the temporal patch (the processor pads the last patch)
    assert sample_indices_qwen3(VideoInfo(20, 10.0, 8, 8)) == [0, 6, 13, 19]
    assert sample_indices_qwen3(VideoInfo(30, 10.0, 8, 8)) == [0, 6, 12, 17, 23, 29]
    twelve = [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]
    assert sample_indices_qwen3(VideoInfo(24, 4.0, 8, 8)) == twelve
    assert sample_indices_qwen3(VideoInfo(3, 30.0, 8, 8)) == [0, 1, 2]
    assert len(sample_indices_qwen3(VideoInfo(100_000, 25.0, 8, 8))) == 768
    assert sample_indices_qwen3(VideoInfo(100, 240.0, 8, 8)) == [0, 33, 66, 99]  # 4 at least
    assert video_loader("Qwen3VLVideoProcessor") == "qwen3_vl"
    assert video_loader("Qwen2VLVideoProcessor") == "qwen2_vl"
    assert video_loader("Glm4vVideoProcessor") == "glm4v"
    assert video_loader("Glm46VVideoProcessor") == "glm46v"
    assert video_loader("Glm5NextVideoProcessor") is None  # vLLM 0.33 has its own loader
    with pytest.raises(DecodeError, match="frame rate"):
        sample_indices_qwen3(VideoInfo(20, None, 8, 8))


def test_sampling_follows_vllm_glm4v_loader() -> None:
    from aiomm.media.video import VideoInfo

    # (values from vLLM 0.33's DynamicVideoBackend) 2 frames a second at ceil(i * fps / 2),
    # distinct; beyond 300 s, 600 frames evenly over the duration
    assert sample_indices_glm4v(VideoInfo(20, 10.0, 8, 8)) == [0, 5, 10, 15]
    assert sample_indices_glm4v(VideoInfo(15, 10.0, 8, 8)) == [0, 5, 10]  # odd: HF pads
    assert sample_indices_glm4v(VideoInfo(3, 1.0, 8, 8)) == [0, 1, 2]
    assert sample_indices_glm4v(VideoInfo(4, 0.5, 8, 8)) == [0, 1, 2, 3]
    long = sample_indices_glm4v(VideoInfo(9000, 25.0, 8, 8))
    assert len(long) == 600 and long[:4] == [0, 16, 31, 46] and long[-2:] == [8985, 8999]
    longer = sample_indices_glm4v(VideoInfo(40000, 100.0, 8, 8))
    assert len(longer) == 600 and longer[:3] == [0, 67, 134] and longer[-2:] == [39934, 39999]
    meta = hash_metadata(VideoInfo(15, 10.0, 8, 8), [0, 5, 10], "glm4v")
    assert meta["video_backend"] == "opencv_dynamic" and meta["duration"] == 1.5
    with pytest.raises(DecodeError, match="too short"):
        sample_indices_glm4v(VideoInfo(5, 30.0, 8, 8))  # vLLM's loader reads no frame
    with pytest.raises(DecodeError, match="frame rate"):
        sample_indices_glm4v(VideoInfo(20, None, 8, 8))


def test_bad_videos_are_typed_errors() -> None:
    with pytest.raises(DecodeError):
        probe_video_vllm(b"not a video at all")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height = 32, 32
    with pytest.raises((EmptyVideoError, DecodeError)):
        probe_video_vllm(buf.getvalue())


def test_the_decoder_probes_each_video_once() -> None:
    from aiomm.vllm.media import VllmDecoder

    decoder = VllmDecoder()
    data = _clip(*CLIPS["vp9_webm"])
    first = decoder.probe_video(data)
    assert decoder.probe_video(bytes(bytearray(data))) is first  # by content, not identity
    assert decoder.sample_video(first) == sample_indices(first)


def test_the_decoder_samples_with_its_loader() -> None:
    from aiomm.errors import ConfigError
    from aiomm.media.video import VideoInfo
    from aiomm.vllm.media import VllmDecoder

    info = VideoInfo(20, 10.0, 8, 8)
    assert VllmDecoder(video_loader="qwen3_vl").sample_video(info) == [0, 6, 13, 19]
    assert VllmDecoder().sample_video(info) == [0, 5, 10, 15]
    assert VllmDecoder(video_loader="glm4v").sample_video(VideoInfo(15, 10.0, 8, 8)) == [0, 5, 10]
    assert VllmDecoder(video_loader="glm46v").sample_video(VideoInfo(8, 8.0, 8, 8)) == [
        0, 2, 3, 4, 6, 7,
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="loader"):
        VllmDecoder(video_loader="glm5next")


def test_sampling_follows_vllm_glm46v_loader() -> None:
    from aiomm.media.video import VideoInfo

    # (values from vLLM 0.33's GLM46VVideoBackend.compute_frames_index_to_sample; its even-count
    # repeat of the last frame is read once, as its reader reads each index once)
    assert sample_indices_glm46v(VideoInfo(8, 8.0, 8, 8)) == [0, 2, 3, 4, 6, 7]
    assert sample_indices_glm46v(VideoInfo(5, 5.0, 8, 8)) == [0, 1, 2, 3, 4]
    assert sample_indices_glm46v(VideoInfo(4, 10.0, 8, 8)) == [0]  # under a second
    mid = sample_indices_glm46v(VideoInfo(90, 29.97, 8, 8))
    assert len(mid) == 18 and mid[:3] == [0, 5, 10] and mid[-1] == 85
    minutes = sample_indices_glm46v(VideoInfo(1000, 25.0, 8, 8))  # 40 s: 1 a second per patch
    assert len(minutes) == 80 and minutes[:3] == [0, 13, 25] and sum(minutes) == 39520
    hours = sample_indices_glm46v(VideoInfo(20000, 30.0, 8, 8))  # capped at 640
    assert len(hours) == 640 and hours[-2:] == [19967, 19999] and sum(hours) == 6399361
    meta = hash_metadata(VideoInfo(8, 8.0, 8, 8), [0, 2, 3, 4, 6, 7], "glm46v")
    assert meta["video_backend"] == "opencv" and meta["do_sample_frames"] is False
    with pytest.raises(DecodeError, match="frame rate"):
        sample_indices_glm46v(VideoInfo(20, None, 8, 8))
