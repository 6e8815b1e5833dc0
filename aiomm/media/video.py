"""Video decoding: encoded video bytes (or a list of frames) -> the sampled frames, with PyAV.

Synchronous; runs in a worker thread. :func:`probe_video` reads the container's header (frame
count, frame rate, size) without decoding a frame; :func:`decode_video` asks the caller's sampler
for the frame indices (the adapter's copy of its HF video processor's ``sample_frames``), checks
the sampled frames against the frame, byte and pixel budgets, then decodes the stream in order and
keeps only the sampled frames: the whole video is never in memory, only the frames kept. The
metadata mirror transformers' ``read_video_pyav`` (``stream.frames`` and ``stream.average_rate``),
so the same indices come out as HF's sampling of the same video; where the header has no frame
count (Matroska, WebM), the packets are counted instead. PyAV is an optional dependency
(``pip install 'aiomm[video]'``).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiomm.errors import DecodeError, EmptyVideoError, InvalidSourceError, VideoTooLargeError

__all__ = (
    "DEFAULT_MAX_VIDEO_BYTES",
    "DEFAULT_MAX_VIDEO_FRAMES",
    "SampledVideo",
    "Sampler",
    "VideoClip",
    "VideoInfo",
    "clip_from_frames",
    "decode_video",
    "import_av",
    "open_container",
    "probe_video",
)

#: sampled frames kept at most per video (HF Qwen-VL's ``max_frames``)
DEFAULT_MAX_VIDEO_FRAMES = 768
#: decoded bytes of a video's sampled frames at most (``frames * height * width * 3``)
DEFAULT_MAX_VIDEO_BYTES = 1 << 30


@dataclass(frozen=True)
class VideoInfo:
    """A video's header: what sampling needs (the fields of HF's ``VideoMetadata``)."""

    total_num_frames: int
    #: frames per second (the stream's average rate); None when the container has none
    fps: float | None
    height: int
    width: int

    @property
    def duration(self) -> float:
        return self.total_num_frames / self.fps if self.fps else 0.0


@dataclass(frozen=True, eq=False)
class VideoClip:
    """The sampled frames of one video and where they came from.

    ``frames`` is ``T x H x W x 3`` uint8; ``frames_indices`` the indices of those frames in the
    source of ``total_num_frames`` frames at ``fps`` (None for frames given without a rate).
    """

    frames: np.ndarray
    fps: float | None
    total_num_frames: int
    frames_indices: tuple[int, ...] = field(default=())

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames, as HF's ``VideoMetadata.sampled_fps``."""
        if self.fps is None:
            return 24.0
        return len(self.frames_indices) / self.total_num_frames * self.fps

    def metadata(self) -> dict[str, Any]:
        """HF's ``video_metadata`` entry of this clip."""
        return {
            "total_num_frames": self.total_num_frames,
            "fps": self.fps,
            "duration": self.total_num_frames / self.fps if self.fps else None,
            "frames_indices": list(self.frames_indices),
            "height": int(self.frames.shape[1]),
            "width": int(self.frames.shape[2]),
        }


@dataclass(frozen=True)
class SampledVideo:
    """A video's sampled frames without their pixels: how many, their size, and where they come
    from (what a routing plan needs of a :class:`VideoClip`)."""

    num_frames: int
    height: int
    width: int
    fps: float | None
    total_num_frames: int
    frames_indices: tuple[int, ...]

    @classmethod
    def of(cls, info: VideoInfo, indices: Sequence[int]) -> SampledVideo:
        """The frames ``indices`` of a video whose header is ``info``."""
        return cls(
            len(indices), info.height, info.width, info.fps, info.total_num_frames, tuple(indices)
        )

    @classmethod
    def of_clip(cls, clip: VideoClip) -> SampledVideo:
        t, height, width = clip.frames.shape[:3]
        return cls(t, height, width, clip.fps, clip.total_num_frames, tuple(clip.frames_indices))


#: ``VideoInfo -> frame indices`` (non-decreasing, within ``[0, total_num_frames)``)
Sampler = Callable[[VideoInfo], Sequence[int]]


def import_av() -> Any:
    """The ``av`` module (PyAV).

    :raises DecodeError: PyAV is not installed.
    """
    try:
        import av
    except ImportError as exc:  # pragma: no cover - the video extra is installed in CI
        raise DecodeError("decoding videos needs PyAV: pip install 'aiomm[video]'") from exc
    return av


def open_container(data: bytes) -> Any:
    """An open PyAV container of the encoded video ``data`` (close it), with a video stream.

    :raises DecodeError: not a video FFmpeg can open.
    :raises EmptyVideoError: no video stream.
    """
    av = import_av()
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise DecodeError(f"not a decodable video ({len(data)} bytes): {exc}") from exc
    if not container.streams.video:
        container.close()
        raise EmptyVideoError(f"the container ({container.format.name}) has no video stream")
    return container


def probe_video(data: bytes) -> VideoInfo:
    """The header of the video in ``data``, without decoding a frame.

    :raises DecodeError: ``data`` is not a video PyAV can open.
    :raises EmptyVideoError: no video stream, or zero frames.
    """
    av = import_av()
    container = open_container(data)
    try:
        stream = container.streams.video[0]
        total = int(stream.frames)
        if total <= 0:  # no count in the header (Matroska, WebM): count the packets
            total = sum(1 for p in container.demux(stream) if p.size)
        rate = stream.average_rate
        info = VideoInfo(
            total_num_frames=total,
            fps=float(rate) if rate else None,
            height=int(stream.height),
            width=int(stream.width),
        )
    except av.FFmpegError as exc:
        raise DecodeError(f"corrupt video header: {exc}") from exc
    finally:
        container.close()
    if info.total_num_frames <= 0:
        raise EmptyVideoError("the video stream has no frames")
    if info.height <= 0 or info.width <= 0:
        raise DecodeError(f"the video stream has no frame size ({info.width}x{info.height})")
    return info


def sampled_bytes(info: VideoInfo, frames: int) -> int:
    """Decoded bytes of ``frames`` RGB frames of the video of ``info``."""
    return frames * info.height * info.width * 3


def check_budget(
    info: VideoInfo, indices: Sequence[int], *, max_frames: int, max_bytes: int, max_pixels: int
) -> None:
    """Refuse sampled frames beyond the budgets, before any is decoded.

    :raises VideoTooLargeError: too many frames, bytes, or pixels per frame.
    :raises DecodeError: indices out of order or out of range.
    """
    n = len(indices)
    if n == 0:
        raise EmptyVideoError("sampling kept no frame of the video")
    # a frame may repeat (GLM-V pads an odd count with the last frame, Qwen3-VL samples more
    # frames than a short video has), but never go back: the decode is one forward pass
    if any(b < a for a, b in itertools.pairwise(indices)) or not (
        0 <= indices[0] and indices[-1] < info.total_num_frames
    ):
        raise DecodeError(
            f"sampled frame indices must not decrease and lie within [0, {info.total_num_frames})"
        )
    if info.height * info.width > max_pixels:
        raise VideoTooLargeError(
            f"video frames of {info.width}x{info.height} exceed the limit of {max_pixels} pixels"
        )
    if n > max_frames:
        raise VideoTooLargeError(f"{n} sampled frames exceed the limit of {max_frames}")
    nbytes = sampled_bytes(info, n)
    if nbytes > max_bytes:
        raise VideoTooLargeError(
            f"{n} sampled frames of {info.width}x{info.height} take {nbytes} bytes, above the "
            f"limit of {max_bytes}"
        )


def decode_video(
    data: bytes,
    sample: Sampler,
    *,
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
    max_pixels: int = 1 << 26,
    info: VideoInfo | None = None,
) -> VideoClip:
    """The frames ``sample`` picks from the video in ``data``, decoded in one pass.

    ``info``: the header, when already probed.

    :raises DecodeError: corrupt or truncated video (fewer frames than the header announced).
    :raises EmptyVideoError: no video stream, or zero frames.
    :raises VideoTooLargeError: the sampled frames exceed a budget (checked before decoding).
    """
    av = import_av()
    info = info or probe_video(data)
    indices = [int(i) for i in sample(info)]
    check_budget(info, indices, max_frames=max_frames, max_bytes=max_bytes, max_pixels=max_pixels)
    wanted = iter(enumerate(indices))
    slot, target = next(wanted)
    out = np.empty((len(indices), info.height, info.width, 3), dtype=np.uint8)
    kept = 0
    container = open_container(data)
    try:
        for i, frame in enumerate(container.decode(video=0)):
            if i < target:
                continue
            rgb = frame.to_ndarray(format="rgb24")
            if rgb.shape != out.shape[1:]:
                raise DecodeError(
                    f"frame {i} is {rgb.shape[1]}x{rgb.shape[0]}, the stream header says "
                    f"{info.width}x{info.height}"
                )
            out[slot] = rgb
            kept += 1
            nxt = next(wanted, None)
            while nxt is not None and nxt[1] == i:  # the same frame sampled again
                out[nxt[0]] = rgb
                kept += 1
                nxt = next(wanted, None)
            if nxt is None:
                break
            slot, target = nxt
    except av.FFmpegError as exc:
        raise DecodeError(f"corrupt video (after {kept} sampled frames): {exc}") from exc
    finally:
        container.close()
    if kept < len(indices):
        if kept == 0 and indices[0] == 0:
            raise EmptyVideoError("the video stream decoded to no frame")
        raise DecodeError(
            f"truncated video: frame {indices[kept]} of {info.total_num_frames} announced could "
            f"not be decoded ({kept} of {len(indices)} sampled frames)"
        )
    return VideoClip(out, info.fps, info.total_num_frames, tuple(indices))


def clip_from_frames(frames: Any, *, max_frames: int, max_bytes: int) -> VideoClip:
    """A clip of frames given in memory: a ``T x H x W x 3`` uint8 array, or a sequence of
    ``H x W x 3`` arrays or PIL images (converted to RGB), all of one size.

    :raises InvalidSourceError: not frames of one size.
    :raises EmptyVideoError: no frame.
    :raises VideoTooLargeError: more frames or bytes than the budget.
    """
    from aiomm.processing.image_ops import to_rgb_array

    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        array = frames
    else:
        try:
            items = [to_rgb_array(f) if not isinstance(f, np.ndarray) else f for f in frames]
        except TypeError as exc:
            raise InvalidSourceError(
                f"a video in memory must be a list of frames, got {type(frames).__name__}"
            ) from exc
        if not items:
            raise EmptyVideoError("a video of zero frames")
        shapes = {np.shape(f) for f in items}
        if len(shapes) != 1:
            raise InvalidSourceError(f"video frames differ in shape: {sorted(shapes)}")
        array = np.stack(items)
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise InvalidSourceError(
            f"video frames must be T x H x W x 3 uint8, got {array.dtype} {list(array.shape)}"
        )
    if array.shape[0] == 0:
        raise EmptyVideoError("a video of zero frames")
    if array.shape[0] > max_frames or array.nbytes > max_bytes:
        raise VideoTooLargeError(
            f"{array.shape[0]} frames ({array.nbytes} bytes) exceed the limits of {max_frames} "
            f"frames and {max_bytes} bytes"
        )
    n = int(array.shape[0])
    return VideoClip(np.ascontiguousarray(array), None, n, tuple(range(n)))
