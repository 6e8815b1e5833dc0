"""Videos read the way vLLM's render server reads them for Qwen2-VL and Qwen2.5-VL.

vLLM 0.33 loads a ``video_url`` with the ``Qwen2VLVideoBackend`` loader over the OpenCV codec
(``VLLM_VIDEO_LOADER_BACKEND`` and ``media_io_kwargs`` left at their defaults). The rule:

* **Header** (OpenCV's FFmpeg capture): the frame rate is the stream's average rate, else
  FFmpeg's guessed rate; the frame count is the stream's ``nb_frames``, else
  ``floor(duration * fps + 0.5)`` with the container's duration (the stream's when the container
  has none), else the number of demuxed packets (streamed WebM, raw H.264).
* **Sampling** (a port of HF's ``Qwen2VLVideoProcessor.sample_frames`` in fps mode, whatever the
  HF processor's own ``do_sample_frames``): ``total / fps * 2`` frames, clamped to
  ``[4, min(768, total)]``, floored to a multiple of the temporal patch (2), at the indices
  ``torch.arange(0, total, total / n).int()`` clamped to the last frame. That float32 range often
  has one index more than ``n``, equal to ``total`` (30 frames at 2.2 fps, 34 at 4.5 fps): vLLM
  then reads the last frame in its place, so an odd number of frames can come out, where HF's own
  sampling would fail. The engine samples with this rule through :class:`VllmDecoder`'s
  ``sample_video`` (:mod:`aiomm.server.media`).
* **Frames**: decoded in stream order and converted to RGB by FFmpeg's swscale. PyAV's
  ``to_ndarray(format="rgb24")`` gives the same bytes as OpenCV's BGR decode flipped to RGB
  (checked on H.264 4:2:0 and 4:4:4, VP8, VP9, MPEG-4 Part 2 and MJPEG with the same FFmpeg),
  so the engine's own PyAV decode is used, in its worker threads and under its byte budget.
* **Hash**: the item hashed is ``(encoded bytes, metadata)``: see :func:`hash_metadata` and
  :func:`aiomm.server.mm_hash.video_mm_hash`.

Known differences: OpenCV's end-of-stream seek that shortens the count of an MP4 whose edit list
hides frames is not reproduced, and vLLM skips frames it cannot decode where aiomm refuses the
video (a typed 400).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from aiomm.errors import DecodeError, EmptyVideoError
from aiomm.video import VideoInfo, _av, _open

__all__ = ("QWEN2_VIDEO_PROCESSORS", "hash_metadata", "probe_video_vllm", "sample_indices")

#: HF video processors whose videos vLLM loads with ``Qwen2VLVideoBackend`` (Qwen2-VL and
#: Qwen2.5-VL); other models' loaders sample otherwise
QWEN2_VIDEO_PROCESSORS = frozenset({"Qwen2VLVideoProcessor"})
_MAX_FPS = 30


def _rate(value: Any) -> float:
    return float(value) if value else 0.0


def probe_video_vllm(data: bytes) -> VideoInfo:
    """The header of the video in ``data`` as vLLM's OpenCV capture reports it.

    :raises DecodeError: not a video FFmpeg can open, or no frame rate.
    :raises EmptyVideoError: no video stream, or zero frames.
    """
    av = _av()
    container = _open(data)
    try:
        stream = container.streams.video[0]
        fps = _rate(stream.average_rate) or _rate(stream.guessed_rate)
        total = int(stream.frames)
        if total == 0:
            if container.duration is not None and container.duration > 0:
                seconds = container.duration / 1_000_000  # AV_TIME_BASE
            elif stream.duration is not None and stream.time_base:
                seconds = float(stream.duration * stream.time_base)
            else:
                seconds = -1.0
            total = math.floor(seconds * fps + 0.5)
        if total <= 0:  # vLLM counts the demuxed packets then
            total = sum(1 for p in container.demux(stream) if p.size)
        height, width = int(stream.height), int(stream.width)
    except av.FFmpegError as exc:
        raise DecodeError(f"corrupt video header: {exc}") from exc
    finally:
        container.close()
    if total <= 0:
        raise EmptyVideoError("the video stream has no frames")
    if fps <= 0:
        raise DecodeError("the video has no frame rate (variable or unknown): cannot sample it")
    return VideoInfo(total_num_frames=total, fps=fps, height=height, width=width)


def sample_indices(
    info: VideoInfo,
    *,
    fps: float = 2,
    min_frames: int = 4,
    max_frames: int = 768,
    temporal_patch_size: int = 2,
) -> list[int]:
    """The frame indices vLLM's ``Qwen2VLVideoBackend`` reads from a video of ``info``: its
    clamped indices without repeats, as its reader keeps them.

    :raises DecodeError: a video too short to sample (fewer frames than a temporal patch).
    """
    total = info.total_num_frames
    tps = temporal_patch_size
    top = math.floor(min(min(max_frames, 768), total) / tps) * tps
    if not info.fps:
        raise DecodeError("sampling a video needs its frame rate")
    n: float = total / info.fps * min(fps, _MAX_FPS)
    n = min(max(n, min_frames), top, total)
    n = math.floor(n / tps) * tps
    if n <= 0:
        raise DecodeError(f"a video of {total} frames is too short to sample ({tps} at least)")
    indices = torch.arange(0, total, total / n).int()
    return sorted(set(torch.clamp(indices, max=total - 1).tolist()))


def hash_metadata(info: VideoInfo, indices: list[int]) -> dict[str, Any]:
    """The metadata dict vLLM's loader returns with the frames (part of the item's hash; the key
    order is vLLM's)."""
    fps = float(info.fps or 0.0)
    total = info.total_num_frames
    return {
        "total_num_frames": total,
        "fps": fps,
        "duration": total / fps if fps > 0 else 0,
        "video_backend": "opencv",
        "frames_indices": list(indices),
        "do_sample_frames": len(indices) == total,
    }
