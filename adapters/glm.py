"""The GLM-V family: GLM-4.1V/4.5V (``Glm4v``), GLM-OCR and GLM-5-Next: images and videos.

References (transformers):

- GLM-4V: ``Glm4vProcessor`` with ``Glm4vImageProcessor`` (torchvision backend) or
  ``Glm4vImageProcessorPil`` (PIL backend);
- GLM-OCR: transformers has no processor of its own for ``glm_ocr`` (its auto mappings name
  none); the checkpoint ``zai-org/GLM-OCR`` ships ``"processor_class": "Glm46VProcessor"`` with
  ``Glm46VImageProcessor`` / ``Glm46VImageProcessorPil``, whose image transform is GLM-4V's;
- GLM-5-Next: ``Glm5NextProcessor`` with ``Glm5NextImageProcessor`` / ``Glm5NextImageProcessorPil``.

The transform (GLM-4V, GLM-OCR): GLM's ``smart_resize`` (images narrower than
``patch_size * merge_size`` are first scaled up; the pixel bounds count ``temporal_patch_size``
frames), bicubic resize, then Qwen-VL rows of ``C * temporal_patch_size * patch_size**2`` values
grouped by ``merge_size**2`` windows. GLM-5-Next fits the image into a canvas sized by a token
budget (``min_image_tokens`` .. ``max_image_tokens``), resizes only the content (never up when the
image already holds the minimum) and pads the canvas with black at the bottom and right before
rescale/normalise, so padded pixels are uint8 0 and normalise like any other pixel.

Each ``<|image|>`` becomes ``grid_t * grid_h * grid_w / merge_size**2`` of them (HF's count uses
the processor's ``merge_size`` attribute); ``<|begin_of_image|>``/``<|end_of_image|>`` around it
stay as they are. The ``native`` transform is proven equal to ``hf`` bit for bit for both backends
by tests/adapters/test_parity.py.

Video (``Glm4vVideoProcessor``; GLM-OCR's ``Glm46VVideoProcessor``; ``Glm5NextVideoProcessor``),
torchvision only in HF: frames sampled as the video processor's ``sample_frames`` (GLM-4V: ``fps``
frames per second up to ``max_duration``; GLM-4.6V: a frame rate chosen by the duration;
GLM-5-Next: ``fps`` per second, at most ``max_frames``; all keep distinct frames and repeat the
last for an even count), every frame resized to one size (the video ``smart_resize``, whose pixel
bounds count every frame; GLM-5-Next: the image's padded canvas with a token budget counting every
frame), Qwen-VL rows of ``temporal_patch_size`` consecutive frames.
The prompt (``replace_video_token``): each ``<|video|>`` becomes, per temporal patch,
``<|begin_of_image|>``, ``grid_h * grid_w / merge_size**2`` ``<|image|>``, ``<|end_of_image|>``
and the timestamp text of the patch's first frame (``replace_frame_token_id``: whole seconds for
GLM-4V, ``"{t:.1f} seconds"`` for GLM-4.6V and GLM-5-Next); ``is_embed`` marks the ``<|image|>``
tokens. The texts are tokenized on their own, which equals HF's ``input_ids`` when a special token
follows ``<|video|>`` (the chat template's ``<|end_of_video|>``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params, size_edges
from aiomm.adapters._stored import hf_class_name
from aiomm.adapters._text_ids import TextIds
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.qwen_vl import (
    SAMPLING_KWARGS,
    check_device_normalization,
    grid_fields_config,
    grid_outputs,
    grid_prompt_updates,
    video_fields_config,
    video_grid,
    video_rows,
    video_smart_resize,
)
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessingError, ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.media.video import SampledVideo, VideoClip, VideoInfo
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import (
    Backend,
    Resample,
    patchify,
    resize,
    to_rgb_array,
)
from aiomm.processing.processor import BaseMultiModalProcessor, image_size, planned_item
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "Glm5NextMultiModalProcessor",
    "GlmVMultiModalProcessor",
    "glm4v_sample_frame_indices",
    "glm4v_smart_resize",
    "glm5_next_canvas",
    "glm5_next_sample_frame_indices",
    "glm46v_sample_frame_indices",
    "timed_frame_indices",
)

GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
    "<|begin_of_video|>", "<|end_of_video|>", "<|image|>", "<|video|>",
)  # fmt: skip
IMAGE_PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO_PLACEHOLDER = "<|begin_of_video|><|video|><|end_of_video|>"
#: the HF processors whose ``replace_video_token`` this adapter reproduces, and the video
#: kwargs their sampling reads (``Glm46VVideoProcessor`` ignores ``fps``)
_VIDEO_SAMPLING_KWARGS = {
    "Glm4vProcessor": frozenset({"do_sample_frames", "fps"}),
    "Glm46VProcessor": frozenset({"do_sample_frames"}),
    "Glm5NextProcessor": frozenset({"do_sample_frames", "fps"}),
}

# Kwargs of the GLM image processors that the transform reads (both transforms honour them).
_COMMON_KWARGS = frozenset({
    "do_resize", "resample", "do_convert_rgb", "rescale_factor", "image_mean", "image_std",
    "patch_size", "temporal_patch_size", "merge_size",
})  # fmt: skip


def glm4v_smart_resize(
    height: int,
    width: int,
    *,
    factor: int,
    temporal_factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """GLM-4V's resize target, identical to transformers' ``glm4v`` ``smart_resize``: the video
    rule (:func:`~aiomm.adapters.qwen_vl.video_smart_resize`) with the image counted as
    ``temporal_factor`` frames against the pixel bounds.

    :raises AspectRatioError: for an aspect ratio above 200 (after scaling up a thin image).
    """
    return video_smart_resize(
        temporal_factor,
        height,
        width,
        factor=factor,
        temporal_factor=temporal_factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        modality="image",
    )


def _unique_even(indices: list[int]) -> list[int]:
    """Distinct indices in order, the last repeated for an even count (both GLM samplers)."""
    uniq = list(dict.fromkeys(indices))
    if len(uniq) & 1:
        uniq.append(uniq[-1])
    return uniq


def _require_fps(info: VideoInfo) -> float:
    if info.fps is None:
        raise ProcessorKwargsError(
            "GLM-V samples frames by time and needs the video's frame rate: pass frames with "
            "do_sample_frames=False"
        )
    return info.fps


def glm4v_sample_frame_indices(info: VideoInfo, *, fps: float, max_duration: float) -> list[int]:
    """The frames ``Glm4vVideoProcessor.sample_frames`` keeps, identical indices: ``fps`` per
    second (evenly over the first ``max_duration`` seconds' worth beyond it), distinct, the last
    repeated for an even count.

    :raises ProcessorKwargsError: a video without a frame rate.
    """
    video_fps = _require_fps(info)
    total = info.total_num_frames
    last = total - 1
    duration = info.duration or round(last / video_fps) + 1
    if duration <= max_duration:
        n = max(math.floor(duration * fps), 1)
        indices = [min(last, math.ceil(i * video_fps / fps)) for i in range(n)]
    else:
        count = int(max_duration * fps)
        if count >= total:
            indices = list(range(total))
        else:
            seconds = np.linspace(0, duration, count, endpoint=True)
            indices = [min(last, math.ceil(t * video_fps)) for t in seconds]
    return _unique_even(indices)


def glm46v_sample_frame_indices(info: VideoInfo, *, temporal_patch_size: int) -> list[int]:
    """The frames ``Glm46VVideoProcessor.sample_frames`` keeps, identical indices: a frame rate
    chosen by the duration (3, 1 or 0.5 per second, per temporal patch), at most 640 frames.

    :raises ProcessorKwargsError: a video without a frame rate.
    """
    video_fps = _require_fps(info)
    total = info.total_num_frames
    duration = info.duration or round((total - 1) / video_fps) + 1
    effective = min(duration, 2400)
    target_fps = 3 if effective <= 30 else 1 if effective <= 300 else 0.5
    extract = min(int(effective * target_fps * temporal_patch_size), 640)
    step = 1 / (temporal_patch_size * target_fps)
    return _timed_indices(total, video_fps, extract, step, int(duration))


def glm5_next_sample_frame_indices(
    info: VideoInfo, *, fps: float, max_duration: float, max_frames: int
) -> list[int]:
    """The frames ``Glm5NextVideoProcessor.sample_frames`` keeps, identical indices: ``fps`` per
    second (over at most ``max_duration`` seconds when positive), at most ``max_frames``.

    :raises ProcessorKwargsError: a video without a frame rate.
    """
    video_fps = _require_fps(info)
    total = info.total_num_frames
    duration = info.duration or round((total - 1) / video_fps) + 1
    max_second = int(duration)  # of the whole video, as HF's
    if max_duration > 0:
        duration = min(duration, max_duration)
    extract = min(int(duration * fps), max_frames)
    return _timed_indices(total, video_fps, extract, 1 / fps, max_second)


def timed_frame_indices(
    total: int, video_fps: float, extract: int, step: float, max_second: int
) -> list[int]:
    """GLM-4.6V's and GLM-5-Next's frame rule, before any deduplication: one frame every
    ``step`` seconds until ``max_second`` (evenly spread instead when that makes fewer or more
    than ``extract``). HF's processors then keep them distinct and even; vLLM's GLM-4.6V loader
    reads each once (``aiomm.vllm.video_media``)."""
    indices: list[int] = []
    if total < extract:
        indices = np.linspace(0, total - 1, extract, dtype=int).tolist()
    else:
        current, per_frame = 0.0, 1 / video_fps
        for i in range(total):
            if i * per_frame >= current:
                current += step
                indices.append(i)
                if current >= max_second:
                    break
    if len(indices) < extract:
        start, end = (indices[0], indices[-1]) if indices else (0, max(total - 1, 0))
        indices = np.linspace(start, end, extract, dtype=int).tolist()
    elif len(indices) > extract:
        indices = np.linspace(0, total - 1, extract, dtype=int).tolist()
    return indices


def _timed_indices(
    total: int, video_fps: float, extract: int, step: float, max_second: int
) -> list[int]:
    return _unique_even(timed_frame_indices(total, video_fps, extract, step, max_second))


def _transform_kwargs(hf_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs the transform reads (the frames are sampled before it)."""
    return {k: v for k, v in hf_kwargs.items() if k not in SAMPLING_KWARGS}


def _align(value: float, factor: int) -> int:
    return math.ceil(value / factor) * factor


def glm5_next_canvas(
    height: int,
    width: int,
    *,
    factor: int,
    temporal_factor: int,
    min_tokens: int,
    max_tokens: int,
    num_frames: int | None = None,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """GLM-5-Next's ``(canvas, content)`` sizes, as transformers' ``glm5_next`` resize computes.

    The canvas is a multiple of ``factor`` within the token budget; the content is the resized
    image placed at its top left (the rest is padded). ``num_frames``: a video's (the video
    processor's resize, whose budget counts every frame); an image counts as
    ``temporal_factor`` frames.

    :raises ProcessorKwargsError: if ``max_tokens`` cannot hold one aligned patch.
    """
    pixels_per_token = temporal_factor * factor**2
    min_pixels = min_tokens * pixels_per_token
    max_pixels = max_tokens * pixels_per_token
    num_frames = temporal_factor if num_frames is None else num_frames
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    canvas_h, canvas_w = _align(height, factor), _align(width, factor)
    if frames * canvas_h * canvas_w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        canvas_h = _align(max(1, math.ceil(height * scale)), factor)
        canvas_w = _align(max(1, math.ceil(width * scale)), factor)
    if frames * canvas_h * canvas_w > max_pixels:
        if max_pixels < frames * factor**2:
            raise ProcessorKwargsError(
                f"max_image_tokens={max_tokens} is too small for one aligned "
                f"{factor}x{factor} patch"
            )
        # The tallest content height whose aligned canvas fits the budget (binary search).
        low, high = 1, height
        canvas_h, canvas_w = factor, factor
        while low <= high:
            mid = (low + high) // 2
            cand_h = _align(mid, factor)
            cand_w = _align(max(1, math.floor(width * mid / height)), factor)
            if frames * cand_h * cand_w <= max_pixels:
                canvas_h, canvas_w = cand_h, cand_w
                low = mid + 1
            else:
                high = mid - 1
    scale = min(canvas_h / height, canvas_w / width)
    if num_frames * height * width >= pixels_per_token * min_tokens:
        scale = min(1.0, scale)
    content_h = max(1, min(canvas_h, math.floor(height * scale)))
    content_w = max(1, min(canvas_w, math.floor(width * scale)))
    return (canvas_h, canvas_w), (content_h, content_w)


# -------------------------------------------------------------------------- offline builders

# zai-org/GLM-4.1V-9B-Thinking's and zai-org/GLM-OCR's preprocessor_config.json (the image
# processor's class defaults otherwise): 112x112 .. 6144 tokens of 28x28, CLIP mean/std.
GLM_CHECKPOINT_IMAGE_PARAMS: dict[str, Any] = {
    "size": {"shortest_edge": 12544, "longest_edge": 9633792},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _builder(prefix: str, image_params: Mapping[str, Any]) -> Callable[..., Any]:
    """``build(backend, **overrides)``: transformers' ``{prefix}Processor`` over the backend's
    ``{prefix}ImageProcessor`` with ``image_params``, and a tokenizer built in code."""

    def build(backend: str = "torchvision", **overrides: Any) -> Any:
        import transformers

        image_cls = getattr(
            transformers,
            {"torchvision": f"{prefix}ImageProcessor", "pil": f"{prefix}ImageProcessorPil"}[
                backend
            ],
        )
        params = {**image_params, **overrides}
        tokenizer = build_tokenizer(GLM_SPECIAL_TOKENS, eos_token="<|endoftext|>")
        return getattr(transformers, f"{prefix}Processor")(
            image_processor=image_cls(**params),
            tokenizer=tokenizer,
            video_processor=getattr(transformers, f"{prefix}VideoProcessor")(),
        )

    return build


GLM4V = _builder("Glm4v", GLM_CHECKPOINT_IMAGE_PARAMS)
#: GLM-OCR ships GLM-4.6V's processor (module docstring)
GLM_OCR = _builder("Glm46V", GLM_CHECKPOINT_IMAGE_PARAMS)
GLM5_NEXT = _builder("Glm5Next", {})


@dataclass(frozen=True)
class _TransformParams:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: Resample
    do_resize: bool
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    # GLM-4V: pixel bounds; GLM-5-Next: token bounds and the canvas factor's extra multiplier
    # (GLM-4V's image processor has none: the default).
    min_bound: int
    max_bound: int
    patch_expand_factor: int = 1


@register(
    Architecture("glm-4v", "Glm4vForConditionalGeneration", GLM4V, "zai-org/GLM-4.1V-9B-Thinking"),
    Architecture("glm-ocr", "GlmOcrForConditionalGeneration", GLM_OCR, "zai-org/GLM-OCR"),
)
class GlmVMultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of GLM-4V (``Glm4vProcessor``) and GLM-OCR (``Glm46VProcessor``): images and
    videos (module docstring).

    A video item is a :class:`~aiomm.media.video.VideoClip` (frames already sampled: see
    :meth:`sample_frames`); its item keeps the timestamps of its temporal patches in
    ``prompt_data`` for the prompt.
    """

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.PATCHES

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
    )
    has_native: ClassVar[bool] = True
    extra_kwargs: ClassVar[frozenset[str]] = frozenset({"size"})

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        #: write each temporal patch's timestamp as its whole seconds (``int(index / fps)``), as
        #: vLLM's GLM-4.6V/GLM-OCR prompt does; HF's (the default) keeps the fraction
        self.whole_second_timestamps = False
        self.image_token_id: int = int(hf_processor.image_token_id)
        self.video_processor: Any = getattr(hf_processor, "video_processor", None)
        sampling = _VIDEO_SAMPLING_KWARGS.get(hf_class_name(hf_processor))
        self.supports_video = sampling is not None and self.video_processor is not None
        self._video_kwargs: frozenset[str] = sampling or frozenset()
        if self.supports_video:
            self.supported_modalities = ("image", "video")  # type: ignore[misc]
            tok = hf_processor.tokenizer
            self.video_token_id: int = int(hf_processor.video_token_id)
            self.begin_image_id = int(tok.convert_tokens_to_ids("<|begin_of_image|>"))
            self.end_image_id = int(tok.convert_tokens_to_ids("<|end_of_image|>"))
            self._text_ids = TextIds(tok)

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads (others would be ignored), and
        the video sampling kwargs the video processor reads."""
        allowed = super().allowed_hf_kwargs() & (_COMMON_KWARGS | self.extra_kwargs)
        return allowed | self._video_kwargs

    def sample_frames(self, info: VideoInfo, hf_kwargs: Mapping[str, Any]) -> list[int]:
        """The indices of the frames the HF video processor samples from a video of ``info``
        (every frame unless ``do_sample_frames``, on by default).

        :raises ProcessorKwargsError: sampling a video without a frame rate.
        """
        vp = self.video_processor
        if not hf_kwargs.get("do_sample_frames", vp.do_sample_frames):
            return list(range(info.total_num_frames))
        if "fps" not in self._video_kwargs:  # GLM-4.6V: the rate follows the duration
            return glm46v_sample_frame_indices(info, temporal_patch_size=vp.temporal_patch_size)
        fps = hf_kwargs.get("fps")
        fps = vp.fps if fps is None else fps
        if hf_class_name(self.hf_processor) == "Glm5NextProcessor":
            return glm5_next_sample_frame_indices(
                info, fps=fps, max_duration=vp.max_duration, max_frames=vp.max_frames
            )
        return glm4v_sample_frame_indices(info, fps=fps, max_duration=vp.max_duration)

    def _bounds(self, hf_kwargs: Mapping[str, Any]) -> tuple[int, int]:
        shortest, longest = size_edges(hf_kwargs.get("size", self.image_processor.size))
        if not shortest or not longest:
            raise ProcessorKwargsError(
                "GLM-V needs size={'shortest_edge': min_pixels, 'longest_edge': max_pixels}"
            )
        return int(shortest), int(longest)

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        min_bound, max_bound = self._bounds(hf_kwargs)
        return resolve_params(
            _TransformParams, self.image_processor, hf_kwargs,
            min_bound=min_bound, max_bound=max_bound,
        )  # fmt: skip

    def _resolve_video_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        # ``size`` applies to the image and the video processor alike, as in HF's call
        shortest, longest = size_edges(hf_kwargs.get("size", self.video_processor.size))
        if not shortest or not longest:
            raise ProcessorKwargsError(
                "GLM-V video needs size={'shortest_edge': min_pixels, 'longest_edge': max_pixels}"
            )
        return resolve_params(
            _TransformParams, self.video_processor, hf_kwargs,
            min_bound=int(shortest), max_bound=int(longest),
        )  # fmt: skip

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        # The dummy text's mm_token_type_ids are dropped anyway, and building them from a tensor
        # makes numpy emit a DeprecationWarning on every call.
        kwargs["return_mm_token_type_ids"] = False
        for key in SAMPLING_KWARGS:
            kwargs.pop(key, None)  # the frames are sampled already
        clips: list[VideoClip] = hf_data.get("videos", [])
        if clips:
            hf_data["videos"] = [c.frames for c in clips]
            kwargs["video_metadata"] = [c.metadata() for c in clips]
            kwargs["do_sample_frames"] = False
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
                self.canvas(*image_size(image), params)
        if hf_data.get("videos"):
            params = self._resolve_video_params(hf_kwargs)
            for frames in hf_data["videos"]:
                # (t, height, width): typed, so that mypy takes the argument after it
                size = cast("tuple[int, int, int]", frames.shape[:3])
                self.video_canvas(*size, params)

    # the transform --------------------------------------------------------------------------

    def canvas(
        self, height: int, width: int, params: _TransformParams
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(canvas, content)`` sizes of an image: the resized image and what it is padded to."""
        if not params.do_resize:
            return (height, width), (height, width)
        target = glm4v_smart_resize(
            height,
            width,
            factor=params.patch_size * params.merge_size,
            temporal_factor=params.temporal_patch_size,
            min_pixels=params.min_bound,
            max_pixels=params.max_bound,
        )
        return target, target

    def transform_image(
        self, image: Any, params: _TransformParams
    ) -> tuple[torch.Tensor, list[int]]:
        """One image -> (rows, [grid_t, grid_h, grid_w])."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        (canvas_h, canvas_w), (height, width) = self.canvas(rgb.shape[0], rgb.shape[1], params)
        unit = params.patch_size * params.merge_size
        if canvas_h % unit or canvas_w % unit:
            raise ProcessingError(
                f"a {canvas_h}x{canvas_w} image does not split into {unit}x{unit} merge windows; "
                "keep do_resize on"
            )
        # the pad, the CPU normalise or patchify copies out of it before the next scratch resize
        chw = resize(rgb, height, width, params.resample, self.backend, scratch=True)
        if (canvas_h, canvas_w) != (height, width):
            chw = F.pad(chw, (0, canvas_w - width, 0, canvas_h - height))
        if not self.device_normalize:
            chw = self._cpu_normalize(chw, params)
        rows = patchify(
            chw,
            patch_size=params.patch_size,
            merge_size=params.merge_size,
            temporal_patch_size=params.temporal_patch_size,
        )
        return rows, [1, canvas_h // params.patch_size, canvas_w // params.patch_size]

    def transform_video(
        self, frames: np.ndarray, params: _TransformParams
    ) -> tuple[torch.Tensor, list[int]]:
        """One video's sampled ``T x H x W x 3`` frames -> (rows, [grid_t, grid_h, grid_w]), as
        the video processor.

        :raises TooFewFramesError: fewer frames than ``temporal_patch_size``.
        :raises AspectRatioError: an aspect ratio above 200.
        """
        t, height, width = frames.shape[:3]
        canvas, (height, width) = self.video_canvas(t, height, width, params)
        normalizer = None if self.device_normalize else self.video_processor
        return video_rows(frames, height, width, params, normalizer, canvas=canvas)

    def video_canvas(
        self, t: int, height: int, width: int, params: _TransformParams
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(canvas, content)`` sizes of the frames of a video of ``t`` sampled frames: GLM-4V's
        video ``smart_resize`` (no padding).

        :raises ItemRejectedError: a video the video processor rejects.
        """
        if not params.do_resize:
            return (height, width), (height, width)
        target = video_smart_resize(
            t, height, width,
            factor=params.patch_size * params.merge_size,
            temporal_factor=params.temporal_patch_size,
            min_pixels=params.min_bound, max_pixels=params.max_bound,
        )  # fmt: skip
        return target, target

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        if hf_data.get("images"):
            params = self._resolve_params(hf_kwargs)
            out.update(grid_outputs([self.transform_image(i, params) for i in hf_data["images"]]))
        if hf_data.get("videos"):
            params = self._resolve_video_params(hf_kwargs)
            if self.device_normalize:
                check_device_normalization(self._resolve_params(hf_kwargs), params)
            done = [self.transform_video(f, params) for f in hf_data["videos"]]
            rows = [r for r, _ in done]
            out["pixel_values_videos"] = rows[0] if len(rows) == 1 else torch.cat(rows)
            out["video_grid_thw"] = torch.tensor([g for _, g in done], dtype=torch.long)
        return out

    # routing plans --------------------------------------------------------------------------

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        params = self._resolve_params(_transform_kwargs(hf_kwargs))
        (canvas_h, canvas_w), _ = self.canvas(height, width, params)
        unit = params.patch_size * params.merge_size
        if canvas_h % unit or canvas_w % unit:
            raise ProcessingError(
                f"a {canvas_h}x{canvas_w} image does not split into {unit}x{unit} merge windows; "
                "keep do_resize on"
            )
        grid = [1, canvas_h // params.patch_size, canvas_w // params.patch_size]
        return planned_item("image", image_grid_thw=grid)

    def plan_video(
        self, video: SampledVideo, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem | None:
        if not self.supports_video:
            return None
        kwargs = _transform_kwargs(hf_kwargs)
        params = self._resolve_video_params(kwargs)
        if self.device_normalize:
            check_device_normalization(self._resolve_params(kwargs), params)
        t = video.num_frames
        (canvas_h, canvas_w), _ = self.video_canvas(t, video.height, video.width, params)
        grid = video_grid(t, canvas_h, canvas_w, params)
        seconds = self.frame_seconds(video.frames_indices, video.fps, grid[0])
        return planned_item("video", {"timestamps": seconds}, video_grid_thw=grid)

    def frame_seconds(
        self, frames_indices: Sequence[int], fps: float | None, grid_t: int
    ) -> list[float]:
        """As ``replace_video_token``: the first frame's time of each temporal patch (every
        second frame, whatever temporal_patch_size), the last repeated to ``grid_t``."""
        rate = 24 if fps is None else fps
        seconds = [i / rate for i in frames_indices][::2]
        if self.whole_second_timestamps:
            seconds = [float(int(t)) for t in seconds]
        seconds = seconds[:grid_t]
        seconds += [seconds[-1] if seconds else 0] * (grid_t - len(seconds))
        return seconds

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        return {**grid_fields_config(outputs), **video_fields_config(outputs)}

    def _set_prompt_data(
        self,
        mm_items: Mapping[str, list[Any]],
        items: Mapping[str, list[MultiModalKwargsItem]],
    ) -> None:
        for clip, item in zip(mm_items.get("video", []), items.get("video", []), strict=True):
            grid_t = int(item.data["video_grid_thw"][0])
            item.prompt_data["timestamps"] = self.frame_seconds(
                clip.frames_indices, clip.fps, grid_t
            )

    def frame_text(self, seconds: float) -> str:
        """The text after a frame's image tokens: the HF processor's ``replace_frame_token_id``
        without its image tokens."""
        full = self.hf_processor.replace_frame_token_id(seconds, num_image_tokens=0)
        return str(full).rpartition("<|end_of_image|>")[2]

    def video_prompt(self, item: MultiModalKwargsItem) -> PromptUpdateDetails:
        """The tokens of one video: per temporal patch its image tokens between
        ``<|begin_of_image|>`` and ``<|end_of_image|>``, then its timestamp text.

        :raises ProcessingError: an item without a timestamp per temporal patch.
        """
        gt, gh, gw = (int(v) for v in item.data["video_grid_thw"])
        merge = int(self.video_processor.merge_size)
        seconds = item.prompt_data.get("timestamps", ())
        if len(seconds) < gt:
            raise ProcessingError(
                f"a GLM-V video item of {gt} temporal patches has {len(seconds)} timestamps"
            )
        frame = [self.begin_image_id, *[self.image_token_id] * (gh * gw // merge**2),
                 self.end_image_id]  # fmt: skip
        ids: list[int] = []
        for t in seconds[:gt]:
            ids += frame
            ids += self._text_ids(self.frame_text(t))
        return PromptUpdateDetails.select_token_id(ids, self.image_token_id)

    def num_image_tokens(self, item: MultiModalKwargsItem) -> int:
        # As Glm4vProcessor.replace_image_token: the processor's merge_size, not the kwarg.
        merge = int(self.image_processor.merge_size)
        return math.prod(item.data["image_grid_thw"].tolist()) // (merge * merge)

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        updates = grid_prompt_updates(
            self.image_token_id, lambda i: self.num_image_tokens(items[i])
        )
        if self.supports_video:
            videos = mm_kwargs.get("video", [])
            updates.append(
                PromptReplacement(
                    "video", [self.video_token_id], lambda i: self.video_prompt(videos[i])
                )
            )
        return updates


@register(
    Architecture(
        "glm-5-next", "Glm5NextForConditionalGeneration", GLM5_NEXT, "zai-org/GLM-5.3-Flash"
    )
)
class Glm5NextMultiModalProcessor(GlmVMultiModalProcessor):
    """Processor of GLM-5-Next (``Glm5NextProcessor``), images and videos: a padded
    token-budget canvas."""

    # ``size`` is ignored by Glm5NextImageProcessor, so it is not accepted here.
    extra_kwargs: ClassVar[frozenset[str]] = frozenset(
        {"patch_expand_factor", "min_image_tokens", "max_image_tokens"}
    )

    def _bounds(self, hf_kwargs: Mapping[str, Any], processor: Any = None) -> tuple[int, int]:
        ip = processor or self.image_processor
        return (
            int(hf_kwargs.get("min_image_tokens", ip.min_image_tokens)),
            int(hf_kwargs.get("max_image_tokens", ip.max_image_tokens)),
        )

    def _resolve_video_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        # the video processor's own token budget (a request's kwargs apply to both, as in HF)
        low, high = self._bounds(hf_kwargs, self.video_processor)
        return resolve_params(
            _TransformParams, self.video_processor, hf_kwargs, min_bound=low, max_bound=high
        )

    def video_canvas(
        self, t: int, height: int, width: int, params: _TransformParams
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """GLM-5-Next's video canvas: the image canvas with a budget counting every frame (the
        video processor, torchvision only, always applies ``patch_expand_factor``)."""
        if not params.do_resize:
            return (height, width), (height, width)
        return glm5_next_canvas(
            height, width,
            factor=params.patch_size * params.merge_size * params.patch_expand_factor,
            temporal_factor=params.temporal_patch_size,
            min_tokens=params.min_bound, max_tokens=params.max_bound, num_frames=t,
        )  # fmt: skip

    def canvas(
        self, height: int, width: int, params: _TransformParams
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        if not params.do_resize:
            return (height, width), (height, width)
        factor = params.patch_size * params.merge_size
        if self.backend is Backend.TORCHVISION:
            # Only the torchvision backend applies patch_expand_factor to the canvas factor.
            factor *= params.patch_expand_factor
        return glm5_next_canvas(
            height,
            width,
            factor=factor,
            temporal_factor=params.temporal_patch_size,
            min_tokens=params.min_bound,
            max_tokens=params.max_bound,
        )
