"""The Qwen-VL family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), Qwen4-Exp; Intern-S.

Reference: transformers' ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` with
``Qwen2VLImageProcessor`` (torchvision backend) or ``Qwen2VLImageProcessorPil`` (PIL backend),
which every member uses for images. Video: ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL) and
``Qwen3VLVideoProcessor`` (Qwen3-VL and every member built on ``Qwen3VLProcessor``), torchvision
only (no PIL backend exists), see :class:`QwenVLProcessor`.

Qwen3-VL's video prompt (``Qwen3VLProcessor.replace_video_token``): each ``<|video_pad|>`` becomes,
per temporal patch, the text ``<{t:.1f} seconds>`` (``t`` the mean timestamp of the patch's first
and last frame) then ``<|vision_start|>``, ``grid_h * grid_w / merge_size**2`` ``<|video_pad|>``
and ``<|vision_end|>``; the ``<|vision_start|>``/``<|vision_end|>`` around the original
``<|video_pad|>`` stay, as in HF's ``input_ids`` (vLLM's prompt update replaces them too). The
placeholder range spans the whole expansion; ``is_embed`` marks its ``<|video_pad|>`` tokens. The
timestamp texts are tokenized on their own, which equals HF's ``input_ids`` when a special token
precedes the ``<|video_pad|>`` (the chat template's ``<|vision_start|>``).

The transform: ``smart_resize`` to a multiple of ``patch_size * merge_size`` within
``[shortest_edge, longest_edge]`` pixels, bicubic resize, then rows of
``C * temporal_patch_size * patch_size**2`` values (the frame repeated ``temporal_patch_size``
times), grouped by ``merge_size**2`` windows. Each ``<|image_pad|>`` becomes
``grid_t * grid_h * grid_w / merge_size**2`` of them.

Intern-S1-Pro and Intern-S2-Mobius are rows of this family. vLLM registers both architectures
with ``Qwen3VLMultiModalProcessor`` and ``Qwen3VLDummyInputsBuilder``
(``vllm/model_executor/models/interns1_pro.py``, and ``interns2_mobius.py`` ->
``interns2_preview.py``), i.e. the checkpoint's HF processor is a Qwen3-VL processor
(``Qwen3VLProcessor`` over ``Qwen2VLImageProcessor``), not InternVL's tiling; sglang agrees for
Intern-S2-Mobius (its Qwen-VL processor lists the architecture). The checkpoints' configs fit that
processor: a Qwen3-VL vision tower with ``patch_size`` 16 and ``temporal_patch_size`` 2, and
``image_token_id`` equal to the Qwen vocabulary's ``<|image_pad|>`` (151655 for Intern-S1-Pro,
248056 for Intern-S2-Mobius, the Qwen3.5 vocabulary). Their offline reference is therefore
``Qwen3VLProcessor`` with the Qwen3-VL preprocessor parameters; a checkpoint's own
``preprocessor_config.json`` overrides them through :func:`~aiomm.adapters.from_pretrained`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params, size_edges
from aiomm.adapters._stored import hf_class_name
from aiomm.adapters._text_ids import TextIds
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import (
    AspectRatioError,
    EmptyResizeError,
    ProcessingError,
    ProcessorKwargsError,
    TooFewFramesError,
)
from aiomm.kernels import ChannelLayout
from aiomm.media.video import SampledVideo, VideoClip, VideoInfo
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import (
    Backend,
    ReducedImage,
    Resample,
    as_tensor_view,
    copy_permuted,
    numpy_copyable,
    patchify,
    resize,
    resize_chw,
    to_rgb_array,
)
from aiomm.processing.processor import BaseMultiModalProcessor, image_size, planned_item
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "QwenVLProcessor",
    "check_device_normalization",
    "grid_fields_config",
    "grid_outputs",
    "grid_prompt_updates",
    "qwen3_sample_frame_indices",
    "qwen3_timestamps",
    "sample_frame_indices",
    "smart_resize",
    "video_grid",
    "video_rows",
    "video_smart_resize",
)

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
#: the HF processors whose video prompt is one run of ``<|video_pad|>`` per video
_PLAIN_VIDEO_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor"})
#: the HF processors whose video prompt interleaves each temporal patch's timestamp
_TIMESTAMP_VIDEO_PROCESSORS = frozenset({"Qwen3VLProcessor"})
#: video kwargs that choose frames: applied when the video is decoded (and part of the cache key)
SAMPLING_KWARGS = frozenset({"do_sample_frames", "fps", "num_frames", "min_frames", "max_frames"})


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    modality: str = "image",
) -> tuple[int, int]:
    """The target (height, width) of Qwen-VL's resize, identical to transformers' ``smart_resize``.
    ``modality`` names the item in an error (a video's frames resize by this rule too).

    :raises AspectRatioError: for an aspect ratio above 200.
    :raises EmptyResizeError: a target of zero pixels on a side (``min_pixels`` of 0).
    """
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise AspectRatioError(modality, height, width, ratio=ratio)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return _nonempty(modality, height, width, (h_bar, w_bar))


def _nonempty(modality: str, height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """``target``, checked before a resize to it could fail in torch or Pillow.

    :raises EmptyResizeError: a side of zero pixels.
    """
    if min(target) <= 0:
        raise EmptyResizeError(modality, height, width, target)
    return target


def video_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    factor: int,
    temporal_factor: int,
    min_pixels: int,
    max_pixels: int,
    modality: str = "video",
) -> tuple[int, int]:
    """The frame size of a video of ``num_frames`` frames, identical to the ``smart_resize`` of
    transformers' Qwen3-VL and GLM-4V video processors: the pixel bounds count every frame, and
    frames narrower than ``factor`` are first scaled up. ``modality`` names the item in an error
    (GLM-V resizes an image by this rule).

    :raises TooFewFramesError: fewer frames than ``temporal_factor``.
    :raises AspectRatioError: an aspect ratio above 200 (after scaling thin frames up).
    :raises EmptyResizeError: a target of zero pixels on a side (``min_pixels`` of 0).
    """
    if num_frames < temporal_factor:
        raise TooFewFramesError(num_frames, temporal_factor)
    source = height, width
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise AspectRatioError(modality, *source, ratio=ratio)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return _nonempty(modality, *source, (h_bar, w_bar))


def grid_outputs(transformed: list[tuple[torch.Tensor, list[int]]]) -> dict[str, Any]:
    """Per-image (rows, grid) pairs -> ``pixel_values`` rows and ``image_grid_thw``."""
    if not transformed:
        return {}
    rows = [r for r, _ in transformed]
    return {
        "pixel_values": rows[0] if len(rows) == 1 else torch.cat(rows),
        # from numpy: torch.tensor releases the GIL (image_ops' module docstring)
        "image_grid_thw": torch.from_numpy(np.array([g for _, g in transformed], dtype=np.int64)),
    }


def grid_prompt_updates(
    token: int, tokens_of: Callable[[int], int], modality: str = "image"
) -> list[PromptUpdate]:
    """Item ``i``'s placeholder token becomes ``tokens_of(i)`` copies of itself."""

    def replacement(i: int) -> PromptUpdateDetails:
        return PromptUpdateDetails.from_seq([token] * tokens_of(i))

    return [PromptReplacement(modality, [token], replacement)]


def sample_frame_indices(
    info: VideoInfo,
    *,
    do_sample_frames: bool,
    fps: float | None,
    num_frames: int | None,
    min_frames: int,
    max_frames: int,
    temporal_patch_size: int,
) -> list[int]:
    """The frames ``Qwen2VLVideoProcessor.sample_frames`` keeps of a video (every frame when
    ``do_sample_frames`` is off), identical indices.

    :raises ProcessorKwargsError: ``fps`` with ``num_frames``, or more frames than the video has.
    """
    total = info.total_num_frames
    if not do_sample_frames:
        return list(range(total))
    if fps is not None and num_frames is not None:
        raise ProcessorKwargsError("fps and num_frames are mutually exclusive")
    tps = temporal_patch_size
    count: float | int | None = None
    if num_frames is not None:
        count = round(num_frames / tps) * tps
    elif fps is not None:
        if info.fps is None:
            raise ProcessorKwargsError("sampling by fps needs a video with a frame rate")
        top = math.floor(min(max_frames, total) / tps) * tps
        count = min(max(total / info.fps * fps, min_frames), top, total)
        count = math.floor(count / tps) * tps
    if count is None:
        return list(range(total))
    if count > total or count <= 0:
        raise ProcessorKwargsError(
            f"cannot sample {count} frames of a video of {total} frames; change fps or num_frames"
        )
    # torch's float arithmetic, as HF computes it, so that the indices are the same
    return torch.arange(0, total, total / count).int().tolist()


def qwen3_sample_frame_indices(
    info: VideoInfo,
    *,
    do_sample_frames: bool,
    fps: float | None,
    num_frames: int | None,
    min_frames: int,
    max_frames: int,
    default_fps: float | None = None,
) -> list[int]:
    """The frames ``Qwen3VLVideoProcessor.sample_frames`` keeps of a video (every frame when
    ``do_sample_frames`` is off), identical indices: ``num_frames`` (or ``fps`` frames per second,
    within ``[min_frames, max_frames]`` and the video's length) spread evenly, first and last
    included. ``fps=None`` means ``default_fps`` (the processor's) unless ``num_frames`` is given.
    A short video may repeat frames (``num_frames`` above its length). A video without a frame
    rate counts as 24 fps, as HF's.

    :raises ProcessorKwargsError: ``fps`` with ``num_frames``, or no frame to sample.
    """
    total = info.total_num_frames
    if not do_sample_frames:
        return list(range(total))
    if fps is not None and num_frames is not None:
        raise ProcessorKwargsError(
            "fps and num_frames are mutually exclusive (Qwen3-VL's video processor samples at "
            "fps=2 by default: pass fps=None with num_frames)"
        )
    fps = default_fps if fps is None else fps
    if num_frames is None and fps is not None:
        video_fps = 24.0 if info.fps is None else info.fps
        num_frames = int(total / video_fps * fps)
        num_frames = min(max(num_frames, min_frames), max_frames, total)
    if num_frames is None:
        num_frames = min(max(total, min_frames), max_frames)
    if num_frames <= 0:
        raise ProcessorKwargsError(f"cannot sample {num_frames} frames of a video")
    return np.linspace(0, total - 1, int(num_frames)).round().astype(int).tolist()


def qwen3_timestamps(
    frames_indices: Sequence[int], fps: float | None, temporal_patch_size: int
) -> list[float]:
    """Seconds of each temporal patch as ``Qwen3VLProcessor._calculate_timestamps``: the mean of
    its first and last frame's time (indices padded with the last one; 24 fps when unknown)."""
    fps = 24 if fps is None else fps
    indices = list(frames_indices)
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    tps = temporal_patch_size
    return [(seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps)]


def grid_fields_config(
    outputs: Mapping[str, Any], *, repeat: tuple[int, int] | None = None
) -> dict[str, MultiModalFieldConfig]:
    """Items of grid-patch processors: ``prod(grid_thw)`` rows each, one grid each.

    ``repeat``: the rows are compact (one frame) and merge into the model's rows by repeating
    each of their ``repeat[0]`` channel blocks ``repeat[1]`` times.
    """
    grid = outputs.get("image_grid_thw")
    sizes = [math.prod(g) for g in grid.tolist()] if grid is not None else []
    return {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes, repeat=repeat),
        "image_grid_thw": MultiModalFieldConfig.batched("image"),
    }


# -------------------------------------------------------------------------- offline builders

# Qwen3-VL and later checkpoints ship this preprocessor config (patch 16, mean/std 0.5, pixel
# bounds 256x256 .. 4096x4096); Qwen2-VL and Qwen2.5-VL use the image processor's defaults.
QWEN3_IMAGE_PARAMS: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def _builder(
    processor_name: str, video_name: str, image_params: Mapping[str, Any]
) -> Callable[..., Any]:
    """``build(backend, **overrides)``: transformers' ``processor_name`` over the backend's
    ``Qwen2VLImageProcessor`` with ``image_params``, and a tokenizer built in code."""

    def build(backend: str = "torchvision", **overrides: Any) -> Any:
        import transformers

        image_cls = {
            "torchvision": transformers.Qwen2VLImageProcessor,
            "pil": transformers.Qwen2VLImageProcessorPil,
        }[backend]
        params = {**image_params, **overrides}
        video_params = {k: v for k, v in params.items() if k != "size"}
        tokenizer = build_tokenizer(QWEN_SPECIAL_TOKENS, eos_token="<|endoftext|>")
        return getattr(transformers, processor_name)(
            image_processor=image_cls(**params),
            tokenizer=tokenizer,
            video_processor=getattr(transformers, video_name)(**video_params),
        )

    return build


QWEN2 = _builder("Qwen2VLProcessor", "Qwen2VLVideoProcessor", {})
QWEN2_5 = _builder("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", {})
#: Qwen3-VL's processor and published parameters: every later member, and the Intern-S rows
QWEN3 = _builder("Qwen3VLProcessor", "Qwen3VLVideoProcessor", QWEN3_IMAGE_PARAMS)


@dataclass(frozen=True)
class _TransformParams:
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: Resample
    do_resize: bool
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


def _pixel_bounded_params(
    processor: Any, hf_kwargs: Mapping[str, Any], what: str
) -> _TransformParams:
    """Transform parameters of an image or video processor whose ``size`` (or the request's
    ``min_pixels`` / ``max_pixels``) bounds the pixels smart_resize keeps.

    :raises ProcessorKwargsError: neither gives both bounds.
    """
    shortest, longest = size_edges(hf_kwargs.get("size", processor.size))
    shortest = hf_kwargs.get("min_pixels", shortest)
    longest = hf_kwargs.get("max_pixels", longest)
    if not shortest or not longest:
        raise ProcessorKwargsError(
            f"{what} needs size={{'shortest_edge': min_pixels, 'longest_edge': max_pixels}}"
        )
    return resolve_params(
        _TransformParams, processor, hf_kwargs, min_pixels=int(shortest), max_pixels=int(longest)
    )


@register(
    Architecture("qwen2-vl", "Qwen2VLForConditionalGeneration", QWEN2,
                 "Qwen/Qwen2-VL-2B-Instruct"),
    Architecture("qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", QWEN2_5,
                 "Qwen/Qwen2.5-VL-3B-Instruct"),
    Architecture("qwen3-vl", "Qwen3VLForConditionalGeneration", QWEN3,
                 "Qwen/Qwen3-VL-4B-Instruct"),
    Architecture("qwen3-vl-moe", "Qwen3VLMoeForConditionalGeneration", QWEN3,
                 "Qwen/Qwen3-VL-30B-A3B-Instruct"),
    Architecture("qwen3.5", "Qwen3_5ForConditionalGeneration", QWEN3, "Qwen/Qwen3.5-0.8B"),
    Architecture("qwen3.5-moe", "Qwen3_5MoeForConditionalGeneration", QWEN3,
                 "Qwen/Qwen3.5-35B-A3B"),
    Architecture("qwen4-exp", "Qwen4ExpForConditionalGeneration", QWEN3,
                 "Qwen/Qwen3.8-Flash-Next"),
    # Qwen3-VL preprocessing as vLLM serves them (module docstring).
    Architecture("intern-s1-pro", "InternS1ProForConditionalGeneration", QWEN3,
                 "internlm/Intern-S1-Pro"),
    Architecture("intern-s2-mobius", "InternS2MobiusForConditionalGeneration", QWEN3,
                 "internlm/Intern-S2-Mobius"),
)  # fmt: skip
class QwenVLProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of every Qwen-VL family architecture: images and videos.

    A video item is a :class:`~aiomm.media.video.VideoClip` (frames already sampled: see
    :meth:`sample_frames`). Its transform is the video processor's: every frame resized to one
    ``smart_resize`` size (the video processor's own pixel bounds; Qwen3-VL's count every
    frame), frames padded to a multiple of ``temporal_patch_size`` with the last one, and rows of
    ``temporal_patch_size`` consecutive real frames (``pixel_values_videos``, uint8 when the
    device normalises; never compact), ``video_grid_thw`` and, for Qwen2.5-VL,
    ``second_per_grid_ts``. Qwen3-VL's items keep their patches' timestamps in ``prompt_data``
    for the prompt (module docstring).
    """

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.PATCHES

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
    )
    has_native: ClassVar[bool] = True
    supports_device_resize: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        self.image_token_id: int = int(hf_processor.image_token_id)
        self.video_processor: Any = getattr(hf_processor, "video_processor", None)
        name = hf_class_name(hf_processor)
        has_video = self.video_processor is not None
        #: Qwen3-VL: timestamps interleaved in the video prompt (module docstring)
        self.timestamps = has_video and name in _TIMESTAMP_VIDEO_PROCESSORS
        self.supports_video = self.timestamps or (has_video and name in _PLAIN_VIDEO_PROCESSORS)
        if self.supports_video:
            self.supported_modalities = ("image", "video")  # type: ignore[misc]
            self.video_token_id: int = int(hf_processor.video_token_id)
            self._seconds_per_grid = name == "Qwen2_5_VLProcessor"
        if self.timestamps:
            self.vision_start_token_id = int(hf_processor.vision_start_token_id)
            self.vision_end_token_id = int(hf_processor.vision_end_token_id)
            self._text_ids = TextIds(hf_processor.tokenizer)

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs, and the video processor's where videos are taken."""
        allowed = super().allowed_hf_kwargs()
        if not self.supports_video:
            return allowed
        typed = self.video_processor.valid_kwargs
        video = set(typed.__required_keys__) | set(typed.__optional_keys__)
        # owned by aiomm: the decode passes the sampled frames and their metadata
        owned = {"do_rescale", "do_normalize", "return_tensors", "device", "video_metadata"}
        return allowed | frozenset(video - owned - {"return_metadata"})

    # kwargs ---------------------------------------------------------------------------------

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        return _pixel_bounded_params(self.image_processor, hf_kwargs, "Qwen-VL")

    def _resolve_video_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        return _pixel_bounded_params(self.video_processor, hf_kwargs, "Qwen-VL video")

    def sample_frames(self, info: VideoInfo, hf_kwargs: Mapping[str, Any]) -> list[int]:
        """The indices of the frames the HF video processor samples from a video of ``info``
        with the request's kwargs (every frame unless ``do_sample_frames``).

        :raises ProcessorKwargsError: for sampling kwargs that do not fit the video.
        """
        vp = self.video_processor

        def get(name: str) -> Any:
            return hf_kwargs.get(name, getattr(vp, name, None))

        if self.timestamps:
            # HF's Qwen3-VL sampling reads min/max_frames from the processor, not the request
            return qwen3_sample_frame_indices(
                info,
                do_sample_frames=bool(get("do_sample_frames")),
                fps=get("fps"),
                num_frames=get("num_frames"),
                min_frames=int(vp.min_frames),
                max_frames=int(vp.max_frames),
                default_fps=vp.fps,
            )
        return sample_frame_indices(
            info,
            do_sample_frames=bool(get("do_sample_frames")),
            fps=get("fps"),
            num_frames=get("num_frames"),
            min_frames=int(get("min_frames")),
            max_frames=int(get("max_frames")),
            temporal_patch_size=int(get("temporal_patch_size")),
        )

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        for key in SAMPLING_KWARGS:
            kwargs.pop(key, None)  # the frames are sampled already
        clips: list[VideoClip] = hf_data.get("videos", [])
        if clips:
            hf_data["videos"] = [c.frames for c in clips]
            kwargs["video_metadata"] = [c.metadata() for c in clips]
            kwargs["do_sample_frames"] = False
            kwargs.setdefault("cap_pixels_per_frame", False)
        self._pixel_bounds_as_size(kwargs, video=bool(clips))
        if self.transform == "hf":
            self._check_items(hf_data, kwargs)
        return hf_data, kwargs, passthrough

    def _check_items(self, hf_data: Mapping[str, Any], hf_kwargs: Mapping[str, Any]) -> None:
        """Refuse, typed, what the HF processor would refuse with a ValueError, before it is
        called (the native transform refuses as it computes each item's size).

        :raises ItemRejectedError: an item the image or video processor refuses.
        """
        if hf_data.get("images"):
            params = self._resolve_params(hf_kwargs)
            for image in hf_data["images"]:
                self.target_size(*image_size(image), params)
        if hf_data.get("videos"):
            params = self._resolve_video_params(hf_kwargs)
            cap = bool(hf_kwargs.get("cap_pixels_per_frame"))
            for frames in hf_data["videos"]:
                # (t, height, width): typed, so that mypy takes the arguments after it
                size = cast("tuple[int, int, int]", frames.shape[:3])
                self.video_frame_size(*size, params, cap)

    # the transform --------------------------------------------------------------------------

    def target_size(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        if not params.do_resize:
            return height, width
        return smart_resize(
            height,
            width,
            factor=params.patch_size * params.merge_size,
            min_pixels=params.min_pixels,
            max_pixels=params.max_pixels,
        )

    def resize_target(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> tuple[int, int] | None:
        if self.transform != "native":
            return None
        params = self._resolve_params(hf_kwargs)
        if params.resample is not Resample.BICUBIC:
            return None
        return self.target_size(height, width, params)

    def transform_image(
        self, image: Any, params: _TransformParams
    ) -> tuple[torch.Tensor, list[int]]:
        """One image -> (rows of one frame, ``[gh * gw, C * P * P]``; [grid_t, gh, gw])."""
        if isinstance(image, ReducedImage):  # fast mode: the target of the source's size
            rgb = image.pixels
            height, width = self.target_size(image.source_height, image.source_width, params)
        else:
            rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
            height, width = self.target_size(rgb.shape[0], rgb.shape[1], params)
        if self.resize_device is not None and self.device_normalize:
            chw = self._resize_on_device(rgb, height, width, params)
        else:
            # patchify (or the CPU normalise) copies out of it before this thread resizes again
            chw = resize(rgb, height, width, params.resample, self.backend, scratch=True)
        if not self.device_normalize:
            chw = self._cpu_normalize(chw, params)
        # One frame: the item (and the cache) keeps compact rows, and the merge repeats each
        # channel block temporal_patch_size times (``grid_fields_config``'s ``repeat``).
        rows = patchify(
            chw, patch_size=params.patch_size, merge_size=params.merge_size, temporal_patch_size=1
        )
        return rows, [1, height // params.patch_size, width // params.patch_size]

    def _resize_on_device(
        self, rgb: np.ndarray, height: int, width: int, params: _TransformParams
    ) -> torch.Tensor:
        """The decoded uint8 image crosses to the device; resize there, bit-exact to the CPU."""
        from aiomm.kernels import ResampleVariant, resize_uint8

        if params.resample is not Resample.BICUBIC:
            return resize(rgb, height, width, params.resample, self.backend)
        variant = (
            ResampleVariant.PIL_BICUBIC
            if self.backend is Backend.PIL
            else ResampleVariant.TORCH_BICUBIC_AA
        )
        src = as_tensor_view(np.ascontiguousarray(rgb))
        src = src.to(self.resize_device)
        if (height, width) != tuple(src.shape[:2]):
            src = resize_uint8(src, height, width, variant, layout="hwc")
        return src.permute(2, 0, 1).contiguous()

    def video_frame_size(
        self, t: int, height: int, width: int, params: _TransformParams, cap: bool
    ) -> tuple[int, int]:
        """The size the frames of a video of ``t`` sampled ``height x width`` frames take, as
        the video processor's ``resize`` (``cap``: qwen-vl-utils' ``cap_pixels_per_frame``).

        :raises ItemRejectedError: a video the video processor rejects (``TooFewFramesError``,
            ``AspectRatioError``, ``EmptyResizeError``).
        """
        if not params.do_resize:
            return height, width
        factor = params.patch_size * params.merge_size
        tps = params.temporal_patch_size
        max_pixels = params.max_pixels
        if self.timestamps:  # Qwen3VLVideoProcessor: the bounds count every frame
            if cap:
                frame_cap = self.video_processor.max_video_tokens * factor * factor
                per_frame = max(min(frame_cap, max_pixels // t), int(params.min_pixels * 1.05))
                max_pixels = per_frame * t
            return video_smart_resize(
                t, height, width, factor=factor, temporal_factor=tps,
                min_pixels=params.min_pixels, max_pixels=max_pixels,
            )  # fmt: skip
        if cap:
            total = int(self.video_processor.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * tps // t), int(params.min_pixels * 1.05))
        return smart_resize(
            height, width, factor=factor, min_pixels=params.min_pixels, max_pixels=max_pixels,
            modality="video",
        )  # fmt: skip

    def transform_video(
        self, clip: VideoClip, params: _TransformParams, cap_pixels_per_frame: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """One video -> (rows ``[gt * gh * gw, C * T * P * P]`` of ``T = temporal_patch_size``
        consecutive frames, ``[grid_t, gh, gw]``), as the video processor."""
        frames = clip.frames
        t, height, width = frames.shape[0], frames.shape[1], frames.shape[2]
        height, width = self.video_frame_size(t, height, width, params, cap_pixels_per_frame)
        return video_rows(
            frames, height, width, params,
            None if self.device_normalize else self.video_processor,
        )  # fmt: skip

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        if hf_data.get("images"):
            params = self._resolve_params(hf_kwargs)
            out.update(grid_outputs([self.transform_image(i, params) for i in hf_data["images"]]))
        clips: list[np.ndarray] = hf_data.get("videos", [])
        if clips:
            params = self._resolve_video_params(hf_kwargs)
            if self.device_normalize:
                check_device_normalization(self._resolve_params(hf_kwargs), params)
            cap = bool(hf_kwargs.get("cap_pixels_per_frame"))
            meta = hf_kwargs["video_metadata"]
            done = [
                self.transform_video(VideoClip(f, m["fps"], m["total_num_frames"],
                                               tuple(m["frames_indices"])), params, cap)
                for f, m in zip(clips, meta, strict=True)
            ]  # fmt: skip
            rows = [r for r, _ in done]
            out["pixel_values_videos"] = rows[0] if len(rows) == 1 else torch.cat(rows)
            out["video_grid_thw"] = torch.tensor([g for _, g in done], dtype=torch.long)
            if self._seconds_per_grid:
                tps = params.temporal_patch_size
                seconds = [tps / _sampled_fps(m) for m in meta]
                out["second_per_grid_ts"] = torch.tensor(seconds)
        return out

    # routing plans --------------------------------------------------------------------------

    def _plan_kwargs(self, hf_kwargs: Mapping[str, Any], *, video: bool) -> dict[str, Any]:
        """The kwargs the transform reads, as :meth:`_get_hf_mm_inputs` rewrites them."""
        kwargs = {k: v for k, v in hf_kwargs.items() if k not in SAMPLING_KWARGS}
        self._pixel_bounds_as_size(kwargs, video=video)
        return kwargs

    def _pixel_bounds_as_size(self, kwargs: dict[str, Any], *, video: bool) -> None:
        """``min_pixels``/``max_pixels`` in ``kwargs`` rewritten as ``size``, in place (passing
        them at call time is deprecated in transformers).

        :raises ProcessorKwargsError: with a video (they would override each processor's own
            size, one size call for both).
        """
        if "min_pixels" not in kwargs and "max_pixels" not in kwargs:
            return
        if video:
            raise ProcessorKwargsError(
                "min_pixels/max_pixels with videos: pass size={'shortest_edge': ..., "
                "'longest_edge': ...} (it applies to images and videos alike)"
            )
        params = self._resolve_params(kwargs)
        kwargs.pop("min_pixels", None)
        kwargs.pop("max_pixels", None)
        kwargs["size"] = {"shortest_edge": params.min_pixels, "longest_edge": params.max_pixels}

    @functools.cached_property
    def _default_params(self) -> _TransformParams:
        return self._resolve_params({})

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        params = (
            self._resolve_params(self._plan_kwargs(hf_kwargs, video=False))
            if hf_kwargs
            else self._default_params  # a request's usual kwargs: none
        )
        height, width = self.target_size(height, width, params)
        grid = [1, height // params.patch_size, width // params.patch_size]
        return planned_item("image", image_grid_thw=grid)

    def plan_video(
        self, video: SampledVideo, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem | None:
        if not self.supports_video:
            return None
        kwargs = self._plan_kwargs(hf_kwargs, video=True)
        params = self._resolve_video_params(kwargs)
        if self.device_normalize:
            check_device_normalization(self._resolve_params(kwargs), params)
        cap = bool(kwargs.get("cap_pixels_per_frame"))
        t = video.num_frames
        height, width = self.video_frame_size(t, video.height, video.width, params, cap)
        grid = video_grid(t, height, width, params)
        prompt_data = None
        if self.timestamps:
            seconds = qwen3_timestamps(
                video.frames_indices, video.fps, int(self.video_processor.temporal_patch_size)
            )
            prompt_data = {"timestamps": seconds}
        return planned_item("video", prompt_data, video_grid_thw=grid)

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        fields = video_fields_config(outputs)
        if self.transform != "native" or "pixel_values" not in outputs:
            return {**grid_fields_config(outputs), **fields}
        params = self._resolve_params(hf_kwargs)
        channels = outputs["pixel_values"].shape[-1] // params.patch_size**2
        repeat = (channels, params.temporal_patch_size)
        return {**grid_fields_config(outputs, repeat=repeat), **fields}

    def num_image_tokens(self, item: MultiModalKwargsItem, hf_kwargs: Mapping[str, Any]) -> int:
        merge = int(hf_kwargs.get("merge_size", self.image_processor.merge_size))
        return math.prod(item.data["image_grid_thw"].tolist()) // (merge * merge)

    def _set_prompt_data(
        self,
        mm_items: Mapping[str, list[Any]],
        items: Mapping[str, list[MultiModalKwargsItem]],
    ) -> None:
        if not self.timestamps:
            return
        tps = int(self.video_processor.temporal_patch_size)  # HF's: the processor's, not a kwarg
        for clip, item in zip(mm_items.get("video", []), items.get("video", []), strict=True):
            seconds = qwen3_timestamps(clip.frames_indices, clip.fps, tps)
            item.prompt_data["timestamps"] = seconds

    def video_prompt(self, item: MultiModalKwargsItem) -> PromptUpdateDetails:
        """Qwen3-VL's tokens of one video: per temporal patch its timestamp text, then its
        vision tokens between ``<|vision_start|>`` and ``<|vision_end|>``.

        :raises ProcessingError: an item without a timestamp per temporal patch.
        """
        gt, gh, gw = (int(v) for v in item.data["video_grid_thw"])
        merge = int(self.video_processor.merge_size)
        seconds = item.prompt_data.get("timestamps", ())
        if len(seconds) < gt:
            raise ProcessingError(
                f"a Qwen3-VL video item of {gt} temporal patches has {len(seconds)} timestamps"
            )
        frame = [self.vision_start_token_id, *[self.video_token_id] * (gh * gw // merge**2),
                 self.vision_end_token_id]  # fmt: skip
        ids: list[int] = []
        for t in seconds[:gt]:
            ids += self._text_ids(f"<{t:.1f} seconds>")
            ids += frame
        return PromptUpdateDetails.select_token_id(ids, self.video_token_id)

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        updates = grid_prompt_updates(
            self.image_token_id, lambda i: self.num_image_tokens(items[i], hf_kwargs)
        )
        if self.timestamps:
            videos = mm_kwargs.get("video", [])
            updates.append(
                PromptReplacement(
                    "video", [self.video_token_id], lambda i: self.video_prompt(videos[i])
                )
            )
        elif self.supports_video:
            videos = mm_kwargs.get("video", [])
            merge = int(hf_kwargs.get("merge_size", self.video_processor.merge_size))

            def video_tokens(i: int) -> int:
                return math.prod(videos[i].data["video_grid_thw"].tolist()) // (merge * merge)

            updates += grid_prompt_updates(self.video_token_id, video_tokens, "video")
        return updates


def video_grid(frames: int, height: int, width: int, params: Any) -> list[int]:
    """``[grid_t, grid_h, grid_w]`` of ``frames`` frames resized to ``height x width`` (padded
    to a multiple of the temporal patch, as :func:`video_rows` pads them)."""
    tps, p = params.temporal_patch_size, params.patch_size
    return [-(-frames // tps), height // p, width // p]


def _sampled_fps(metadata: Mapping[str, Any]) -> float:
    """HF's ``VideoMetadata.sampled_fps`` of a ``video_metadata`` entry."""
    fps = metadata["fps"]
    if fps is None:
        return 24.0
    return len(metadata["frames_indices"]) / metadata["total_num_frames"] * fps


def video_rows(
    frames: np.ndarray,
    height: int,
    width: int,
    params: Any,
    normalizer: Any | None,
    *,
    canvas: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """``T x H x W x 3`` uint8 frames -> the rows and grid of the Qwen-VL / GLM-V video
    processors: resized to ``height x width`` as one batch, padded with black at the bottom and
    right to ``canvas`` (GLM-5-Next), normalised by ``normalizer`` (the HF video processor's own
    ``rescale_and_normalize``; None: left uint8), padded to a multiple of
    ``params.temporal_patch_size`` with the last frame, patchified (:func:`patchify_video`)."""
    t, tps = frames.shape[0], params.temporal_patch_size
    # T x C x H x W with channels-last strides: resize reads any strides
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if (height, width) != tuple(video.shape[-2:]):
        video = resize_frames(video, height, width, params.resample)
    if canvas is not None and canvas != (height, width):
        video = torch.nn.functional.pad(video, (0, canvas[1] - width, 0, canvas[0] - height))
    if normalizer is not None:
        # the video processor's own operation: the classic path equals HF's bit for bit
        video = normalizer.rescale_and_normalize(
            video.float(), True, params.rescale_factor, True,
            tuple(params.image_mean), tuple(params.image_std),
        )  # fmt: skip
    if pad := -t % tps:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
    return patchify_video(video, patch_size=params.patch_size, merge_size=params.merge_size,
                          temporal_patch_size=tps)  # fmt: skip


def check_device_normalization(image: Any, video: Any) -> None:
    """The device normalises a request's images and videos with one set of parameters (the
    image processor's): refuse a video processor that normalises otherwise.

    :raises ProcessingError: the two differ in ``rescale_factor``, ``image_mean`` or
        ``image_std``.
    """

    def key(p: Any) -> tuple[Any, ...]:
        return p.rescale_factor, tuple(p.image_mean), tuple(p.image_std)

    if key(image) != key(video):
        raise ProcessingError(
            f"the video processor normalises with {key(video)}, the image processor with "
            f"{key(image)}; the device normalises with one: use mm_device_do_normalize=False"
        )


def resize_frames(video: torch.Tensor, height: int, width: int, resample: Resample) -> torch.Tensor:
    """``T x C x H x W`` uint8 frames resized as the video processor resizes them: one batch."""
    return resize_chw(video, height, width, resample)


def patchify_video(
    video: torch.Tensor, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """``T x C x H x W`` frames (``T`` a multiple of ``temporal_patch_size``) -> Qwen-VL rows
    ``[gt * gh * gw, C * tps * P * P]`` (merge windows adjacent; channel-major, then frame) and
    ``[gt, gh, gw]``. One copy, no dtype change."""
    t, c, h, w = video.shape
    p, m, tps = patch_size, merge_size, temporal_patch_size
    gt, gh, gw = t // tps, h // p, w // p
    x = video.reshape(gt, tps, c, gh // m, m, p, gw // m, m, p)
    order, rows = (0, 3, 6, 4, 7, 2, 1, 5, 8), (gt * gh * gw, c * tps * p * p)
    if numpy_copyable(x):
        return copy_permuted(x, order, rows), [gt, gh, gw]
    return x.permute(order).reshape(rows), [gt, gh, gw]


def video_fields_config(outputs: Mapping[str, Any]) -> dict[str, MultiModalFieldConfig]:
    """Video items: ``prod(video_grid_thw)`` full rows each, one grid (and duration) each."""
    grid = outputs.get("video_grid_thw")
    if grid is None:
        return {}
    fields = {
        "pixel_values_videos": MultiModalFieldConfig.flat_from_sizes("video", grid.prod(-1)),
        "video_grid_thw": MultiModalFieldConfig.batched("video"),
    }
    if "second_per_grid_ts" in outputs:
        fields["second_per_grid_ts"] = MultiModalFieldConfig.batched("video")
    return fields
