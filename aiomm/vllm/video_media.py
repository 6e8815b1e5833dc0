"""Videos read the way vLLM's render server reads them for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

vLLM 0.33 loads a ``video_url`` with the ``Qwen2VLVideoBackend`` loader over the OpenCV codec
(``VLLM_VIDEO_LOADER_BACKEND`` and ``media_io_kwargs`` left at their defaults). The rule:

* **Header** (OpenCV's FFmpeg capture): the frame rate is the stream's average rate, else
  FFmpeg's guessed rate; the frame count is the stream's ``nb_frames``, else
  ``floor(duration * fps + 0.5)`` with the container's duration (the stream's when the container
  has none), else the number of demuxed packets (streamed WebM, raw H.264). A count more than one
  frame above OpenCV's position after seeking to the end (a variable frame rate, an MP4 edit
  list) is replaced by that position, as vLLM does; PyAV replays OpenCV's seek with the same
  FFmpeg. Sampled frames past the frames really there are skipped, as vLLM's reader skips them.
* **Sampling** (a port of HF's ``Qwen2VLVideoProcessor.sample_frames`` in fps mode, whatever the
  HF processor's own ``do_sample_frames``): ``total / fps * 2`` frames, clamped to
  ``[4, min(768, total)]``, floored to a multiple of the temporal patch (2), at the indices
  ``torch.arange(0, total, total / n).int()`` clamped to the last frame. That float32 range often
  has one index more than ``n``, equal to ``total`` (30 frames at 2.2 fps, 34 at 4.5 fps): vLLM
  then reads the last frame in its place, so an odd number of frames can come out, where HF's own
  sampling would fail. The engine samples with this rule through :class:`VllmDecoder`'s
  ``sample_video`` (:mod:`aiomm.vllm.media`).
* **Qwen3-VL** (``Qwen3VLVideoBackend``, the same header and reader): ``int(total / fps * 2)``
  frames, clamped to ``[4, min(768, total)]``, at ``np.linspace(0, total - 1, n).round()``
  (:func:`sample_indices_qwen3`; HF's ``Qwen3VLVideoProcessor`` rule with vLLM's own bounds, not
  the processor's). The prompt's timestamps come from these indices and the header's rate.
* **GLM-4V** (``DynamicVideoBackend``, ``"opencv_dynamic"``, the same header and reader): with
  the duration ``total / fps``, ``floor(duration * 2)`` frames at ``ceil(i * fps / 2)`` (clamped
  to the last frame, distinct, sorted) up to 300 s, else 600 frames at ``ceil(t * fps)`` for ``t``
  evenly over the duration (:func:`sample_indices_glm4v`; HF's ``Glm4vVideoProcessor`` rule with
  vLLM's defaults). The metadata names the backend ``"opencv_dynamic"``.
* **GLM-OCR** (``GLM46VVideoBackend``, ``"glm46v"``, for ``Glm46VVideoProcessor``; the same
  header and reader, backend ``"opencv"``): a rate chosen by the duration ``total / fps`` (3, 1
  or 0.5 frames a second per temporal patch up to 30 s, 300 s, beyond), at most 640 frames, one
  every step until the whole seconds run out, evenly spread instead when that gives fewer or more
  (:func:`sample_indices_glm46v`; HF's ``Glm46VVideoProcessor`` rule). Its last-frame repeat for
  an even count is a duplicate the reader reads once. The prompt's timestamps are whole seconds
  (``int(index / fps)``, written ``"0.0 seconds"``), where HF's are fractional.
* **LLaVA-OneVision** (vLLM's default ``"opencv"`` loader, ``VideoBackend``, for
  ``LlavaOnevisionVideoProcessor``; the same header and reader): ``min(32, total)`` frames
  (``VideoMediaIO``'s ``num_frames``; no rate bound), every frame when that is all of them, else
  ``np.linspace(0, total - 1, n, dtype=int)`` (:func:`sample_indices_uniform`).
* **Frames**: decoded in stream order and converted to RGB by FFmpeg's swscale. PyAV's
  ``to_ndarray(format="rgb24")`` gives the same bytes as OpenCV's BGR decode flipped to RGB
  (checked on H.264 4:2:0 and 4:4:4, VP8, VP9, MPEG-4 Part 2 and MJPEG with the same FFmpeg),
  so the engine's own PyAV decode is used, in its worker threads and under its byte budget.
* **Hash**: the item hashed is ``(encoded bytes, metadata)``: see :func:`hash_metadata` and
  :func:`aiomm.vllm.mm_hash.video_mm_hash`.

Known difference: vLLM skips frames it cannot decode where aiomm refuses the video (a typed 400).
The seek costs a decode of the stream's last group of pictures, as it does in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aiomm.adapters.glm import timed_frame_indices
from aiomm.errors import DecodeError, EmptyVideoError
from aiomm.media.video import VideoInfo, import_av, open_container

__all__ = (
    "GLM4V_VIDEO_PROCESSORS",
    "GLM46V_VIDEO_PROCESSORS",
    "LLAVA_ONEVISION_VIDEO_PROCESSORS",
    "QWEN2_VIDEO_PROCESSORS",
    "QWEN3_VIDEO_PROCESSORS",
    "VIDEOS_PER_PROMPT",
    "VllmVideoInfo",
    "hash_metadata",
    "probe_video_vllm",
    "sample_indices",
    "sample_indices_glm4v",
    "sample_indices_glm46v",
    "sample_indices_qwen3",
    "sample_indices_uniform",
    "video_loader",
)

#: HF video processors whose videos vLLM loads with ``Qwen2VLVideoBackend`` (Qwen2-VL and
#: Qwen2.5-VL); other models' loaders sample otherwise
QWEN2_VIDEO_PROCESSORS = frozenset({"Qwen2VLVideoProcessor"})
#: HF video processors whose videos vLLM loads with ``Qwen3VLVideoBackend`` (Qwen3-VL)
QWEN3_VIDEO_PROCESSORS = frozenset({"Qwen3VLVideoProcessor"})
#: HF video processors whose videos vLLM loads with ``DynamicVideoBackend`` (GLM-4.1V/4.5V)
GLM4V_VIDEO_PROCESSORS = frozenset({"Glm4vVideoProcessor"})
#: HF video processors whose videos vLLM loads with ``GLM46VVideoBackend`` (GLM-OCR, GLM-4.6V)
GLM46V_VIDEO_PROCESSORS = frozenset({"Glm46VVideoProcessor"})
#: HF video processors whose videos vLLM loads with its default ``"opencv"`` loader
#: (``VideoBackend``: 32 frames spread evenly), as for LLaVA-OneVision (and Gemma 4, which
#: vLLM 0.33 gives no loader of its own)
LLAVA_ONEVISION_VIDEO_PROCESSORS = frozenset(
    {"LlavaOnevisionVideoProcessor", "Gemma4VideoProcessor"}
)
#: videos one prompt may carry, per loader's model, where vLLM caps them
#: (``get_supported_mm_limits``: the GLM-4V family takes one)
VIDEOS_PER_PROMPT = {"glm4v": 1, "glm46v": 1}
#: the ``video_backend`` each loader writes into the metadata (part of the hash)
_BACKEND_NAMES = {
    "qwen2_vl": "opencv",
    "qwen3_vl": "opencv",
    "glm4v": "opencv_dynamic",
    "glm46v": "opencv",
    "opencv": "opencv",
}
_MAX_FPS = 30


@dataclass(frozen=True)
class VllmVideoInfo(VideoInfo):
    """A header as OpenCV reports it, and, when its frame count was estimated from the duration,
    the frames a reader really gets (the demuxed packets): vLLM skips the sampled frames past
    them, and so does :func:`sample_indices`."""

    readable_frames: int | None = None
    #: the stream was read to its end at frame ``total_num_frames`` (OpenCV's seek to the end
    #: landed there): the header's count is the frames a decode gets
    end_seen: bool = False


def _rate(value: Any) -> float:
    return float(value) if value else 0.0


def _end_position(data: bytes, total: int, fps: float) -> tuple[int, bool]:
    """OpenCV's ``CAP_PROP_POS_FRAMES`` after ``set(CAP_PROP_POS_AVI_RATIO, 1.0)`` (its
    ``CvCapture_FFMPEG::seek`` to frame ``total``: a backward seek to ``total - delta`` frames'
    time, the landing frame numbered by its timestamp, then read to the end), and whether the
    stream ended there. vLLM's metadata rule takes this position over a larger header count."""
    av = import_av()
    container = open_container(data)
    try:
        stream = container.streams.video[0]
        start = stream.start_time or 0
        time_base = float(stream.time_base)

        def number(frame: Any) -> int:  # OpenCV's dts_to_frame_number
            return int((frame.pts - start) * time_base * fps + 0.5)

        first_frame = next(container.decode(stream), None)
        if first_frame is None or first_frame.pts is None:
            return total, False
        first = number(first_frame)
        delta, position = 16, total
        while True:
            back = max(total - delta, 0)
            container.seek(start + int(back / fps / time_base + 0.5), backward=True, stream=stream)
            frames = container.decode(stream)
            frame = next(frames, None)
            if frame is None or frame.pts is None:
                return total, False
            position = number(frame) - first
            if position < 0 or position > total - 1:
                if back == 0:
                    return position, False
                delta = delta * 2 if delta < 16 else delta * 3 // 2
                continue
            while position < total - 1 and next(frames, None) is not None:
                position += 1
            return position + 1, next(frames, None) is None
    except (av.FFmpegError, ValueError, OverflowError, ArithmeticError, TypeError):
        return total, False  # no usable position (or no time base): the header's count stands
    finally:
        container.close()


def probe_video_vllm(data: bytes) -> VideoInfo:
    """The header of the video in ``data`` as vLLM's OpenCV capture reports it.

    :raises DecodeError: not a video FFmpeg can open, or no frame rate.
    :raises EmptyVideoError: no video stream, or zero frames.
    """
    av = import_av()
    container = open_container(data)
    try:
        stream = container.streams.video[0]
        fps = _rate(stream.average_rate) or _rate(stream.guessed_rate)
        total = int(stream.frames)
        readable = None
        end_seen = False
        if total == 0:
            if container.duration is not None and container.duration > 0:
                seconds = container.duration / 1_000_000  # AV_TIME_BASE
            elif stream.duration is not None and stream.time_base:
                seconds = float(stream.duration * stream.time_base)
            else:
                seconds = -1.0
            total = math.floor(seconds * fps + 0.5)
            readable = sum(1 for p in container.demux(stream) if p.size)
        if total <= 0:  # vLLM counts the demuxed packets then
            total = readable if readable is not None else 0
        elif total > 1 and fps > 0:  # without a rate there is no seek (refused below)
            visible, at_end = _end_position(data, total, fps)
            if at_end and 0 < visible < total - 1:
                total = visible  # vLLM trusts its end-of-stream position over the header
            end_seen = at_end and visible == total
        height, width = int(stream.height), int(stream.width)
    except av.FFmpegError as exc:
        raise DecodeError(f"corrupt video header: {exc}") from exc
    finally:
        container.close()
    if total <= 0:
        raise EmptyVideoError("the video stream has no frames")
    if height <= 0 or width <= 0:
        raise DecodeError(f"the video stream has no frame size ({width}x{height})")
    if fps <= 0:
        raise DecodeError("the video has no frame rate (variable or unknown): cannot sample it")
    return VllmVideoInfo(total, fps, height, width, readable_frames=readable, end_seen=end_seen)


def _frame_rate(info: VideoInfo) -> float:
    """The video's frame rate, which every vLLM sampler divides by.

    :raises DecodeError: the header gives none.
    """
    fps = float(info.fps or 0.0)
    if fps <= 0:
        raise DecodeError("sampling a video needs its frame rate")
    return fps


def sample_indices(
    info: VideoInfo,
    *,
    fps: float = 2,
    min_frames: int = 4,
    max_frames: int = 768,
    temporal_patch_size: int = 2,
) -> list[int]:
    """The frame indices vLLM's ``Qwen2VLVideoBackend`` reads from a video of ``info``: its
    clamped indices without repeats, as its reader keeps them, and none past the frames a reader
    gets (:class:`VllmVideoInfo`; an estimated count can exceed them).

    :raises DecodeError: a video too short to sample (fewer frames than a temporal patch).
    :raises EmptyVideoError: no sampled frame can be read.
    """
    total = info.total_num_frames
    tps = temporal_patch_size
    top = math.floor(min(min(max_frames, 768), total) / tps) * tps
    n: float = total / _frame_rate(info) * min(fps, _MAX_FPS)
    n = min(max(n, min_frames), top, total)
    n = math.floor(n / tps) * tps
    if n <= 0:
        raise DecodeError(f"a video of {total} frames is too short to sample ({tps} at least)")
    indices = torch.arange(0, total, total / n).int()
    kept = sorted(set(torch.clamp(indices, max=total - 1).tolist()))
    return _readable(kept, info)


def sample_indices_qwen3(
    info: VideoInfo, *, fps: float = 2, min_frames: int = 4, max_frames: int = 768
) -> list[int]:
    """The frame indices vLLM's ``Qwen3VLVideoBackend`` reads from a video of ``info`` (none past
    the frames a reader gets, as :func:`sample_indices`).

    :raises DecodeError: a video without a frame rate.
    :raises EmptyVideoError: no sampled frame can be read.
    """
    total = info.total_num_frames
    n = int(total / _frame_rate(info) * min(fps, _MAX_FPS))
    n = min(max(n, min_frames), min(max_frames, 768), total)
    kept: list[int] = np.linspace(0, total - 1, n).round().astype(int).tolist()
    return _readable(kept, info)


def sample_indices_glm4v(
    info: VideoInfo, *, fps: float = 2, max_duration: float = 300
) -> list[int]:
    """The frame indices vLLM's ``DynamicVideoBackend`` (GLM-4V) reads from a video of ``info``
    (none past the frames a reader gets, as :func:`sample_indices`).

    :raises DecodeError: a video without a frame rate, or too short to give a frame.
    :raises EmptyVideoError: no sampled frame can be read.
    """
    total = info.total_num_frames
    video_fps = _frame_rate(info)
    duration = total / video_fps
    last = total - 1
    if duration <= max_duration:
        count = math.floor(duration * fps)
        chosen = {min(last, math.ceil(i * video_fps / fps)) for i in range(count)}
    elif (count := int(max_duration * fps)) >= total:
        chosen = set(range(total))
    else:
        seconds = np.linspace(0, duration, count, endpoint=True)
        chosen = {min(last, math.ceil(t * video_fps)) for t in seconds}
    if not chosen:  # under half a second: vLLM's loader reads no frame
        raise DecodeError(f"a video of {duration:.3f} s is too short to sample at {fps} fps")
    kept = sorted(chosen)
    return _readable(kept, info)


def sample_indices_glm46v(info: VideoInfo, *, temporal_patch_size: int = 2) -> list[int]:
    """The frame indices vLLM's ``GLM46VVideoBackend`` (GLM-OCR) reads from a video of ``info``:
    distinct and sorted, as its reader keeps them (none past the frames a reader gets, as
    :func:`sample_indices`).

    :raises DecodeError: a video without a frame rate.
    :raises EmptyVideoError: no sampled frame can be read.
    """
    total = info.total_num_frames
    video_fps = _frame_rate(info)
    duration = total / video_fps
    effective = min(duration, 2400)
    target_fps = 3.0 if effective <= 30 else 1.0 if effective <= 300 else 0.5
    extract = min(int(effective * target_fps * temporal_patch_size), 640)
    step = 1 / (temporal_patch_size * target_fps)
    indices = timed_frame_indices(total, video_fps, extract, step, int(duration))
    kept = sorted(set(indices))
    return _readable(kept, info)


def sample_indices_uniform(info: VideoInfo, *, num_frames: int = 32) -> list[int]:
    """The frame indices vLLM's default ``"opencv"`` loader (``VideoBackend``, LLaVA-OneVision)
    reads from a video of ``info``: ``min(num_frames, total)`` frames, all of them in order when
    that is every frame, else ``np.linspace(0, total - 1, n, dtype=int)`` (distinct: the step is
    at least one frame); none past the frames a reader gets, as :func:`sample_indices`.

    :raises EmptyVideoError: no sampled frame can be read.
    """
    total = info.total_num_frames
    n = max(1, min(num_frames, total))
    if n == total:
        return _readable(list(range(total)), info)
    kept: list[int] = np.linspace(0, total - 1, n, dtype=int).tolist()
    return _readable(kept, info)


def _readable(kept: list[int], info: VideoInfo) -> list[int]:
    """``kept`` without the frames past those a reader gets (vLLM's reader skips them).

    :raises EmptyVideoError: none is left.
    """
    readable = getattr(info, "readable_frames", None)
    if readable is not None:
        kept = [i for i in kept if i < readable]
    if not kept:
        raise EmptyVideoError("none of the sampled frames can be read")
    return kept


def video_loader(video_processor_class: str | None) -> str | None:
    """The vLLM video loader aiomm reproduces for a model whose HF video processor has this class
    name: ``"qwen2_vl"``, ``"qwen3_vl"``, ``"glm4v"``, ``"glm46v"``, ``"opencv"`` (vLLM's default
    loader, for LLaVA-OneVision), or None (vLLM samples that model's videos otherwise)."""
    if video_processor_class in QWEN2_VIDEO_PROCESSORS:
        return "qwen2_vl"
    if video_processor_class in QWEN3_VIDEO_PROCESSORS:
        return "qwen3_vl"
    if video_processor_class in GLM4V_VIDEO_PROCESSORS:
        return "glm4v"
    if video_processor_class in GLM46V_VIDEO_PROCESSORS:
        return "glm46v"
    if video_processor_class in LLAVA_ONEVISION_VIDEO_PROCESSORS:
        return "opencv"
    return None


def hash_metadata(info: VideoInfo, indices: list[int], loader: str = "qwen2_vl") -> dict[str, Any]:
    """The metadata dict vLLM's ``loader`` (:func:`video_loader`) returns with the frames (part
    of the item's hash; the key order is vLLM's)."""
    fps = float(info.fps or 0.0)
    total = info.total_num_frames
    return {
        "total_num_frames": total,
        "fps": fps,
        "duration": total / fps if fps > 0 else 0,
        "video_backend": _BACKEND_NAMES[loader],
        "frames_indices": list(indices),
        "do_sample_frames": len(indices) == total,
    }
