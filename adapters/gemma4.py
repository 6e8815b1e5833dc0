"""Gemma 4 (``Gemma4ForConditionalGeneration``), images and videos.

Reference: transformers' ``Gemma4Processor`` with ``Gemma4ImageProcessor`` (torchvision backend)
or ``Gemma4ImageProcessorPil`` (PIL backend), as ``google/gemma-4-E4B-it`` configures them:
patches of 16 pixels pooled 3 x 3 into one soft token, 280 soft tokens per image by default
(``max_soft_tokens``, one of 70, 140, 280, 560, 1120 per request), bicubic, pixels rescaled to
``[0, 1]`` and not normalised.

The transform, per image: convert to RGB; resize (preserving the aspect ratio, bicubic; skipped
when the size already fits) to the largest multiple of 48 pixels on each side that keeps at most
``max_soft_tokens * 9`` patches (a side that would round to nothing becomes 48 and the other at
most ``max_soft_tokens * 48 / 3``); cut into 16 x 16 patches, each flattened row-major with the
channels last (``[16 * 16 * 3]``), rows in raster order; pad with zero patches to
``max_soft_tokens * 9`` rows. ``pixel_position_ids`` holds each patch's ``(column, row)``, and
``(-1, -1)`` for the padding. Items are laid out as vLLM's render server sends them: both fields
batched (``[max_patches, 768]`` and ``[max_patches, 2]``). The device stage rescales the uint8
patches (the channels share one scale and no mean or std, so the ``PATCHES`` layout normalises
them exactly); vLLM's Gemma 4 takes the rescaled pixels, so the CPU path is the default.

Prompt: each ``<|image|>`` becomes ``<|image>`` + ``<|image|>`` x n + ``<image|>``, only the soft
tokens taking embeddings, with ``n`` counted as vLLM's processor counts it from the image's size
(``Gemma4ProcessingInfo._compute_num_soft_tokens``: equal to the patches the transform keeps,
divided by 9).

Videos, as vLLM 0.33's ``Gemma4MultiModalProcessor`` renders them (Gemma 4 has no video tower):
every frame vLLM's loader hands over (its default ``"opencv"`` loader: 32 frames spread evenly,
:func:`aiomm.vllm.video_media.sample_indices_uniform`) goes through the image transform above with
``max_soft_tokens`` 70, whatever the request's. A video item holds its frames' patches and
positions (``pixel_values_videos`` ``[frames, 630, 768]``, ``pixel_position_ids_videos``
``[frames, 630, 2]``; flat fields, split by the videos' frame counts, as vLLM concatenates a
request's videos), ``video_frame_counts`` (an int64 scalar), ``video_num_soft_tokens`` (a list,
each frame's count) and ``video_timestamps`` (a list of seconds, ``index / fps`` with the source
frame indices and rate, 24 fps when the rate is unknown); the last three batched, kept on the CPU.
Each ``<|video|>`` becomes, per frame, the tokens of ``"mm:ss "`` (``" mm:ss "`` after the first
frame; whole minutes and seconds, truncated) then ``<|image>`` + ``<|video|>`` x n + ``<image|>``,
only the ``<|video|>`` tokens taking embeddings (vLLM's ``get_video_repl``).

Audio is not handled (refused as an unsupported modality).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import PIL.Image
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.media.video import SampledVideo, VideoClip, VideoInfo
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import FieldConfig, MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import Backend, Resample, resize, to_rgb_array
from aiomm.processing.processor import (
    BaseMultiModalProcessor,
    NormalizationParams,
    check_uint8_exact,
    image_size,
    planned_item,
)
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "SUPPORTED_SOFT_TOKENS",
    "VIDEO_MAX_SOFT_TOKENS",
    "Gemma4MultiModalProcessor",
    "gemma4_num_soft_tokens",
    "gemma4_target_size",
    "gemma4_timestamp",
)

IMAGE_TOKEN, BOI, EOI = "<|image|>", "<|image>", "<image|>"
AUDIO_TOKEN, BOA, EOA = "<|audio|>", "<|audio>", "<audio|>"
VIDEO_TOKEN = "<|video|>"
GEMMA4_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", BOI, EOI, IMAGE_TOKEN, BOA, EOA, AUDIO_TOKEN,
    VIDEO_TOKEN,
)  # fmt: skip
IMAGE_PLACEHOLDER = IMAGE_TOKEN
#: the ``max_soft_tokens`` values the image processor (and vLLM's processor) accept
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
#: soft tokens per video frame at most (vLLM's ``_VIDEO_MAX_SOFT_TOKENS``, whatever the request's)
VIDEO_MAX_SOFT_TOKENS = 70
#: the frame rate vLLM assumes for a video whose metadata has none
_DEFAULT_VIDEO_FPS = 24

# Kwargs of Gemma4ImageProcessor the transform reads. patch_size and pooling_kernel_size are left
# out: vLLM counts an image's tokens with the vision tower's, whatever a request says.
_KWARGS = frozenset({"max_soft_tokens", "resample", "do_convert_rgb", "rescale_factor"})


def gemma4_target_size(
    height: int, width: int, *, patch_size: int, max_patches: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """The size Gemma 4's image processor resizes a ``height x width`` image to, as
    transformers' ``get_aspect_ratio_preserving_size`` computes it."""
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    unit = pooling_kernel_size * patch_size
    target_h = math.floor(factor * height / unit) * unit
    target_w = math.floor(factor * width / unit) * unit
    # (both cannot round to zero: their product before flooring is target_px)
    max_side = (max_patches // pooling_kernel_size**2) * unit
    if target_h == 0:
        target_h, target_w = unit, min(math.floor(width / height) * unit, max_side)
    elif target_w == 0:
        target_h, target_w = min(math.floor(height / width) * unit, max_side), unit
    return target_h, target_w


def gemma4_num_soft_tokens(
    height: int, width: int, *, patch_size: int, pooling_kernel_size: int, max_soft_tokens: int
) -> int:
    """The soft tokens of a ``height x width`` image as vLLM's Gemma 4 processor counts them for
    the prompt (``_compute_num_soft_tokens``)."""
    unit = patch_size * pooling_kernel_size
    max_patches = max_soft_tokens * pooling_kernel_size**2
    scale = math.sqrt(max_patches / ((height / patch_size) * (width / patch_size)))
    target_h = max(unit, math.floor(height * scale / unit) * unit)
    target_w = max(unit, math.floor(width * scale / unit) * unit)
    patches = (target_h // patch_size) * (target_w // patch_size)
    return min(patches // pooling_kernel_size**2, max_soft_tokens)


def gemma4_timestamp(seconds: float) -> str:
    """A frame's ``mm:ss`` as vLLM's ``get_video_repl`` writes it (truncated, zero-padded)."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def _clip_parts(video: Any) -> tuple[np.ndarray, list[float]]:
    """A video item's ``T x H x W x 3`` frames and their timestamps (``index / fps`` as vLLM
    computes them from the loader's metadata: every frame in order, 24 fps, when unknown)."""
    if isinstance(video, VideoClip):
        frames, fps, indices = video.frames, video.fps, video.frames_indices
    else:
        frames, fps, indices = np.asarray(video), None, ()
    rate = fps or _DEFAULT_VIDEO_FPS
    return frames, [i / rate for i in (indices or range(len(frames)))]


# -------------------------------------------------------------------------- offline builder

# google/gemma-4-E4B-it's preprocessor_config.json and processor_config.json.
GEMMA4_IMAGE_PARAMS: dict[str, Any] = {
    "patch_size": 16,
    "max_soft_tokens": 280,
    "pooling_kernel_size": 3,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "do_normalize": False,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
}
GEMMA4_VIDEO_PARAMS: dict[str, Any] = {
    "patch_size": 16,
    "max_soft_tokens": 70,
    "pooling_kernel_size": 3,
    "num_frames": 32,
}
GEMMA4_PROCESSOR_PARAMS: dict[str, Any] = {
    "image_seq_length": 280,
    "audio_seq_length": 750,
    "audio_ms_per_token": 40,
}


def build_gemma4_tokenizer() -> Any:
    """Gemma 4's special tokens, the image and audio tokens as its tokenizer names them, on the
    offline word-level tokenizer."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(GEMMA4_SPECIAL_TOKENS, eos_token="<eos>")
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        unk_token="<unk>", eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
        extra_special_tokens={
            "image_token": IMAGE_TOKEN, "boi_token": BOI, "eoi_token": EOI,
            "audio_token": AUDIO_TOKEN, "boa_token": BOA, "eoa_token": EOA,
        },
    )  # fmt: skip


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``Gemma4Processor`` of Gemma 4 E4B, with a tokenizer built in code."""
    import transformers
    from transformers.models.gemma4 import Gemma4AudioFeatureExtractor, Gemma4VideoProcessor

    image_cls = {
        "torchvision": transformers.Gemma4ImageProcessor,
        "pil": transformers.Gemma4ImageProcessorPil,
    }[backend]
    return transformers.Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image_cls(**{**GEMMA4_IMAGE_PARAMS, **overrides}),
        tokenizer=build_gemma4_tokenizer(),
        video_processor=Gemma4VideoProcessor(**GEMMA4_VIDEO_PARAMS),
        **GEMMA4_PROCESSOR_PARAMS,
    )


@dataclass(frozen=True)
class _TransformParams:
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    resample: Resample
    do_convert_rgb: bool
    rescale_factor: float

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


@register(
    Architecture(
        "gemma4", "Gemma4ForConditionalGeneration", build_hf_processor, "google/gemma-4-E4B-it"
    )
)
class Gemma4MultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of Gemma 4 (``Gemma4Processor``), images and videos (each frame an image of
    at most 70 soft tokens; module docstring). A video item is a
    :class:`~aiomm.media.video.VideoClip` (or ``T x H x W x 3`` frames, 24 fps)."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.PATCHES

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video")
    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER, "video": VIDEO_TOKEN}
    )
    # vLLM's Gemma 4 takes the rescaled pixels (its model does not rescale on the device)
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        tokenizer = hf_processor.tokenizer
        vocab = tokenizer.get_vocab()
        self.image_token_id = int(hf_processor.image_token_id)
        self.boi_token_id = int(vocab[hf_processor.boi_token])
        self.eoi_token_id = int(vocab[hf_processor.eoi_token])
        self.video_token_id = int(hf_processor.video_token_id)
        self.video_processor: Any = hf_processor.video_processor
        #: the tokens of each timestamp text (``"mm:ss "``, ``" mm:ss "``), as encoded so far
        self._timestamp_ids: dict[str, list[int]] = {}

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image kwargs the transform reads."""
        return super().allowed_hf_kwargs() & _KWARGS

    def validate_hf_kwargs(self, hf_kwargs: Mapping[str, Any]) -> None:
        """Reject unknown kwargs and a ``max_soft_tokens`` the processor does not take.

        :raises ProcessorKwargsError: either.
        """
        super().validate_hf_kwargs(hf_kwargs)
        self._resolve_params(hf_kwargs)

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        """The request's parameters over the image processor's.

        :raises ProcessorKwargsError: a ``max_soft_tokens`` the processor does not take.
        """
        params = resolve_params(_TransformParams, self.image_processor, hf_kwargs)
        if params.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ProcessorKwargsError(
                f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, "
                f"got {params.max_soft_tokens}"
            )
        return params

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        p = self._resolve_params(hf_kwargs)
        # rescaled only (the image processor's do_normalize is off): no mean, unit std
        return NormalizationParams(p.rescale_factor, (0.0,) * 3, (1.0,) * 3, self.pixel_layout)

    def num_soft_tokens(self, height: int, width: int, params: _TransformParams) -> int:
        """An image's soft tokens, as vLLM's processor counts them."""
        return gemma4_num_soft_tokens(
            height, width, patch_size=params.patch_size,
            pooling_kernel_size=params.pooling_kernel_size, max_soft_tokens=params.max_soft_tokens,
        )  # fmt: skip

    # the transform --------------------------------------------------------------------------

    def target_size(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        return gemma4_target_size(
            height, width, patch_size=params.patch_size, max_patches=params.max_patches,
            pooling_kernel_size=params.pooling_kernel_size,
        )  # fmt: skip

    def _rescale(self, patches: torch.Tensor, params: _TransformParams) -> torch.Tensor:
        """The classic path's rescale, with the backend's own operation (elementwise, so equal
        on patches to HF's rescale of the image)."""
        if self.backend is Backend.TORCHVISION:
            return self.image_processor.rescale(patches, params.rescale_factor)
        array = self.image_processor.rescale(patches.numpy()[None], params.rescale_factor)[0]
        return torch.from_numpy(np.asarray(array, dtype=np.float32))

    def transform_image(
        self, image: Any, params: _TransformParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One image -> its padded patches ``[max_patches, P * P * C]`` (uint8, or rescaled on the
        classic path) and their positions ``[max_patches, 2]``."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        height, width = self.target_size(rgb.shape[0], rgb.shape[1], params)
        chw = resize(rgb, height, width, params.resample, self.backend)
        p = params.patch_size
        c, rows, cols = chw.shape[0], height // p, width // p
        patches = torch.zeros((params.max_patches, p * p * c), dtype=torch.uint8)
        n = rows * cols
        patches[:n].view(rows, cols, p, p, c).copy_(
            chw.reshape(c, rows, p, cols, p).permute(1, 3, 2, 4, 0)
        )
        positions = torch.full((params.max_patches, 2), -1, dtype=torch.long)
        positions[:n, 0] = torch.arange(cols).repeat(rows)
        positions[:n, 1] = torch.arange(rows).repeat_interleave(cols)
        if not self.device_normalize:
            patches = self._rescale(patches, params)
        return patches, positions

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        per_image = [self.transform_image(image, params) for image in hf_data.get("images", [])]
        out: dict[str, Any] = {}
        if per_image:
            out["pixel_values"] = torch.stack([pv for pv, _ in per_image])
            out["pixel_position_ids"] = torch.stack([pos for _, pos in per_image])
        if videos := hf_data.get("videos"):
            frame_params = self._frame_params(params)
            per_video = []
            for video in videos:
                frames, _ = _clip_parts(video)
                per_frame = [self.transform_image(frame, frame_params) for frame in frames]
                per_video.append(
                    (
                        torch.stack([pv for pv, _ in per_frame]),
                        torch.stack([p for _, p in per_frame]),
                    )
                )
            out.update(self._video_outputs(videos, per_video, frame_params))
        return out

    # videos -----------------------------------------------------------------------------------

    def sample_frames(self, info: VideoInfo, hf_kwargs: Mapping[str, Any]) -> list[int]:
        """Every frame of a video of ``info``: vLLM's processor takes every frame it is handed
        (its render server samples them with its loader first, as :class:`VllmDecoder` does)."""
        return list(range(info.total_num_frames))

    def _frame_params(self, params: _TransformParams) -> _TransformParams:
        """The image parameters of a video's frames: the request's, with vLLM's 70 soft tokens."""
        return dataclasses.replace(params, max_soft_tokens=VIDEO_MAX_SOFT_TOKENS)

    def _video_outputs(
        self,
        videos: Sequence[Any],
        per_video: Sequence[tuple[torch.Tensor, torch.Tensor]],
        frame_params: _TransformParams,
    ) -> dict[str, Any]:
        """The video fields of ``videos`` from each one's frame patches and positions."""
        counts, tokens, stamps = [], [], []
        for video, (pixels, _) in zip(videos, per_video, strict=True):
            frames, seconds = _clip_parts(video)
            n = self.num_soft_tokens(frames.shape[1], frames.shape[2], frame_params)
            counts.append(int(pixels.shape[0]))
            tokens.append([n] * len(frames))
            stamps.append(seconds)
        return {
            "pixel_values_videos": torch.cat([pv for pv, _ in per_video]),
            "pixel_position_ids_videos": torch.cat([pos for _, pos in per_video]),
            "video_frame_counts": torch.tensor(counts, dtype=torch.long),
            "video_num_soft_tokens": tokens,
            "video_timestamps": stamps,
        }

    def _call_hf_processor(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        """The HF processor called as vLLM calls it when a request has videos: its images in one
        call, each video's frames in their own, as images of at most 70 soft tokens."""
        videos = hf_data.get("videos")
        if self.transform == "native" or not videos:
            return super()._call_hf_processor(hf_data, hf_kwargs)
        out: dict[str, Any] = {}
        if images := hf_data.get("images"):
            text = [IMAGE_PLACEHOLDER * len(images)]
            done = super()._call_hf_processor({"text": text, "images": images}, hf_kwargs)
            out.update(
                pixel_values=done["pixel_values"], pixel_position_ids=done["image_position_ids"]
            )
        frame_kwargs = {**hf_kwargs, "max_soft_tokens": VIDEO_MAX_SOFT_TOKENS}
        per_video = []
        for video in videos:
            frames, _ = _clip_parts(video)
            # as vLLM hands them over: one image of each frame, each after a tab
            images = [PIL.Image.fromarray(frame) for frame in frames]
            one = {"text": [("\t" + IMAGE_TOKEN) * len(frames)], "images": images}
            done = super()._call_hf_processor(one, frame_kwargs)
            per_video.append((done["pixel_values"], done["image_position_ids"]))
        out.update(
            self._video_outputs(
                videos, per_video, self._frame_params(self._resolve_params(hf_kwargs))
            )
        )
        return out

    def plan_video(self, video: SampledVideo, hf_kwargs: Mapping[str, Any]) -> MultiModalKwargsItem:
        frame_params = self._frame_params(self._resolve_params(hf_kwargs))
        n = self.num_soft_tokens(video.height, video.width, frame_params)
        rate = video.fps or _DEFAULT_VIDEO_FPS
        indices = video.frames_indices or range(video.num_frames)
        return planned_item(
            "video",
            {
                "video_num_soft_tokens": [n] * video.num_frames,
                "video_timestamps": [i / rate for i in indices],
            },
        )

    def video_tokens(
        self, seconds: Sequence[float], soft_tokens: Sequence[int]
    ) -> PromptUpdateDetails:
        """The tokens of a video whose frames are at ``seconds`` with ``soft_tokens`` each
        (vLLM's ``get_video_repl``)."""
        ids: list[int] = []
        for i, (t, n) in enumerate(zip(seconds, soft_tokens, strict=True)):
            text = f" {gemma4_timestamp(t)} " if i else f"{gemma4_timestamp(t)} "
            prefix = self._timestamp_ids.get(text)
            if prefix is None:
                tokenizer = self.hf_processor.tokenizer
                prefix = self._timestamp_ids[text] = tokenizer.encode(
                    text, add_special_tokens=False
                )
            ids += prefix
            ids.append(self.boi_token_id)
            ids += [self.video_token_id] * n
            ids.append(self.eoi_token_id)
        return PromptUpdateDetails.select_token_id(ids, self.video_token_id)

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        # vLLM's names; the soft-token counts are the prompt's (counted from the image sizes)
        data.pop("num_soft_tokens_per_image", None)
        if "image_position_ids" in data:
            data["pixel_position_ids"] = data.pop("image_position_ids")
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        if self.device_normalize:
            for key in ("pixel_values", "pixel_values_videos"):
                if key in data:
                    data[key] = check_uint8_exact(key, data[key])
        return data

    def process_items(
        self,
        mm_items: Mapping[str, list[Any]],
        hf_kwargs: Mapping[str, Any],
        *,
        validated: bool = False,
    ) -> dict[str, list[MultiModalKwargsItem]]:
        """The base class's items, each image's soft-token count in its ``prompt_data`` (counted
        from the image's size, as vLLM counts it)."""
        items = super().process_items(mm_items, hf_kwargs, validated=validated)
        if items.get("image"):
            params = self._resolve_params(hf_kwargs)
            for image, item in zip(mm_items["image"], items["image"], strict=True):
                item.prompt_data["tokens"] = self.num_soft_tokens(*image_size(image), params)
        return items

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        params = self._resolve_params(hf_kwargs)
        return planned_item("image", {"tokens": self.num_soft_tokens(height, width, params)})

    # fields, updates ------------------------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        fields: dict[str, FieldConfig] = {
            "pixel_values": MultiModalFieldConfig.batched("image"),
            "pixel_position_ids": MultiModalFieldConfig.batched("image"),
        }
        counts = outputs.get("video_frame_counts")
        if counts is not None:
            # a request's videos' frames in one batch, split by their frame counts (vLLM's)
            fields.update(
                pixel_values_videos=MultiModalFieldConfig.flat_from_sizes("video", counts),
                pixel_position_ids_videos=MultiModalFieldConfig.flat_from_sizes("video", counts),
                video_frame_counts=MultiModalFieldConfig.batched("video"),
                video_num_soft_tokens=MultiModalFieldConfig.batched("video"),
                video_timestamps=MultiModalFieldConfig.batched("video"),
            )
        return fields

    def image_tokens(self, num_soft_tokens: int) -> PromptUpdateDetails:
        """The tokens of an image of ``num_soft_tokens`` soft tokens."""
        ids = [self.boi_token_id, *[self.image_token_id] * num_soft_tokens, self.eoi_token_id]
        return PromptUpdateDetails.select_token_id(ids, self.image_token_id)

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        videos = mm_kwargs.get("video", [])

        def replacement(i: int) -> PromptUpdateDetails:
            return self.image_tokens(int(items[i].prompt_data["tokens"]))

        def video_replacement(i: int) -> PromptUpdateDetails:
            # a processed item's fields, or a routing plan's prompt data
            item = videos[i]
            source = item.data if "video_timestamps" in item.data else item.prompt_data
            return self.video_tokens(source["video_timestamps"], source["video_num_soft_tokens"])

        return [
            PromptReplacement("image", [self.image_token_id], replacement),
            PromptReplacement("video", [self.video_token_id], video_replacement),
        ]
