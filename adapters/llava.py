"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``) and LLaVA-OneVision
(``LlavaOnevisionForConditionalGeneration``), images.

Reference: transformers' ``LlavaNextProcessor`` with ``LlavaNextImageProcessor`` (torchvision
backend) or ``LlavaNextImageProcessorPil`` (PIL backend), as ``llava-hf/llava-v1.6-mistral-7b-hf``
configures them: CLIP ViT-L/14 at 336 px, ``size={"shortest_edge": 336}``, ``crop_size`` 336,
the grid ``image_grid_pinpoints`` ``[[336, 672], [672, 336], [672, 672], [1008, 336], [336,
1008]]``, bicubic, CLIP mean/std; and ``LlavaOnevisionProcessor`` with
``LlavaOnevisionImageProcessor`` / ``LlavaOnevisionImageProcessorPil`` as
``llava-hf/llava-onevision-qwen2-7b-ov-hf`` configures them: SigLIP at 384 px, patches of
``size`` 384 (no crop), the 36 grids of 1 to 6 patches a side, mean/std 0.5. Prompt counts
follow vLLM 0.33's ``vllm/model_executor/models/llava_next.py`` and ``llava_onevision.py``.

The transform ("anyres"), per image:

1. the best grid resolution (:func:`select_best_resolution`: the most of the image kept, then
   the least area wasted);
2. resize keeping the aspect ratio to fit it (:func:`fit_size`), pad with zeros to it, centred
   (the odd pixel right or bottom), and cut it into patches of the crop size (OneVision: of
   ``size``), row-major;
3. the base image, the whole image resized (squashed) to the patch size, goes first;
4. rescale/normalise every patch (on the CPU by default: vLLM takes both families' pixels
   normalised, in the model's dtype).

HF pads a batch to its most patches with zero patches (after normalising); vLLM's render server
sends each image's row of that batch (``pixel_values`` ``[most patches, 3, side, side]``,
batched) with ``image_sizes`` (the image's ``[height, width]``, batched, kept on the CPU). Here
each item holds only its own patches, so a cached item never depends on its batch: merging items
(:class:`PaddedPatchesField`) pads them to the most patches again, which reproduces HF's batch
exactly, and the render server pads each item of a request to the request's most patches.

Each ``<image>`` becomes ``<image>`` x (base + unpadded + newline features), all embeddings. For
LLaVA-NeXT, ``(336/14)^2`` base features (the CLS dropped by
``vision_feature_select_strategy="default"``), and for a ``rows x cols`` grid the ``24 * rows x
24 * cols`` feature map with the padding the resize left cropped away (:func:`unpadded_features`),
plus one newline per row. OneVision: 729 base features (27 x 27, no CLS), the same map of 27 per
patch, scaled down to about 9 patches' features when larger (``anyres_max_9``). vLLM counts them
from the image's size and the model config (not from the processed pixels); HF's processors
count the same for the images vLLM hands them (one flat list: every image gets its grid).

OneVision's videos (``LlavaOnevisionVideoProcessor``, the torchvision video processor on both
image backends): every frame given is taken (HF's ``do_sample_frames`` is off; vLLM's render
server hands over the 32 frames its default loader reads, :mod:`aiomm.vllm.video_media`),
squashed to ``size`` (384 x 384, bicubic, antialiased, the frames as one batch), rescaled and
normalised: ``pixel_values_videos`` ``[frames, 3, 384, 384]`` per video, a batched field (vLLM
processes each video in its own HF call, so videos of different lengths are a list; the images
of such a request in one call of their own). Each ``<video>`` becomes ``<video>`` x
(``ceil(27 / 2)^2 = 196`` pooled features per frame, and one newline), all embeddings (vLLM's
``get_num_video_tokens``, which reads only the frame count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.qwen_vl import check_device_normalization
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ConfigError
from aiomm.kernels import ChannelLayout
from aiomm.media.video import SampledVideo, VideoClip, VideoInfo
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import (
    FieldConfig,
    FieldKind,
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    PaddedPatchesField,
)
from aiomm.processing.image_ops import Resample, resize, resize_chw, to_rgb_array
from aiomm.processing.processor import (
    BaseMultiModalProcessor,
    check_uint8_exact,
    image_size,
    planned_item,
)
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "LlavaNextMultiModalProcessor",
    "LlavaOnevisionMultiModalProcessor",
    "VideoFramesField",
    "anyres_grid",
    "fit_size",
    "select_best_resolution",
    "unpadded_features",
)

IMAGE_PLACEHOLDER = "<image>"
LLAVA_NEXT_SPECIAL_TOKENS = ("<s>", "</s>", "[INST]", "[/INST]", IMAGE_PLACEHOLDER)

# Kwargs of LlavaNextImageProcessor the transform reads. The grid (image_grid_pinpoints, size,
# crop_size) is left out: vLLM counts an image's tokens from the model config's grid, so a
# request changing it would get pixels that disagree with its prompt.
_KWARGS = frozenset({"resample", "do_convert_rgb", "rescale_factor", "image_mean", "image_std"})


# ---------------------------------------------------------------------------- the anyres grid


def select_best_resolution(
    height: int, width: int, pinpoints: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """The ``(height, width)`` of ``pinpoints`` transformers' ``select_best_resolution`` picks
    for an image: the most of its pixels kept when scaled to fit, then the least area wasted
    (the first wins ties; an image so thin that every fit floors a side to no pixels keeps none
    anywhere, and gets the smallest resolution).

    :raises ConfigError: no resolutions.
    """
    if not pinpoints:
        raise ConfigError("image_grid_pinpoints is empty")
    best = (0, 0)
    max_effective, min_wasted = 0, math.inf
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_w * pin_h - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best = effective, wasted, (int(pin_h), int(pin_w))
    return best


def fit_size(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """The size an image is resized to within ``target_h x target_w`` keeping its aspect ratio
    (transformers' ``get_patch_output_size``: the tighter side exact, the other rounded up)."""
    if target_w / width < target_h / height:
        return min(math.ceil(height * (target_w / width)), target_h), target_w
    return target_h, min(math.ceil(width * (target_h / height)), target_w)


def anyres_grid(
    height: int, width: int, pinpoints: Sequence[Sequence[int]], patch: int
) -> tuple[int, int]:
    """``(rows, cols)`` of ``patch``-sized patches the best resolution holds."""
    best = select_best_resolution(height, width, pinpoints)
    return best[0] // patch, best[1] // patch


def unpadded_features(
    height: int, width: int, npatches: int, rows: int, cols: int, *, max_patches: int | None = None
) -> tuple[int, int]:
    """``(unpadded, newline)`` feature counts of a ``rows x cols`` grid of ``npatches``-square
    feature maps once the padding the resize left is cropped (vLLM's
    ``_get_num_unpadded_features``); ``max_patches`` (OneVision's ``anyres_max_N``) scales a
    larger map down to about that many patches' features."""
    current_h, current_w = npatches * rows, npatches * cols
    if width / height > current_w / current_h:
        new_h = int(round(height * (current_w / width), 7))
        current_h -= 2 * ((current_h - new_h) // 2)
    else:
        new_w = int(round(width * (current_h / height), 7))
        current_w -= 2 * ((current_w - new_w) // 2)
    unpadded, newline = current_h * current_w, current_h
    if max_patches is not None:
        ratio = math.sqrt(current_h * current_w / (max_patches * npatches**2))
        if ratio > 1.1:
            unpadded = int(current_h // ratio) * int(current_w // ratio)
            newline = int(current_h // ratio)
    return unpadded, newline


# ----------------------------------------------------------------------------- the field


@dataclass(frozen=True)
class VideoFramesField(MultiModalFieldConfig):
    """OneVision's ``pixel_values_videos``: a batched field of ``[frames, C, H, W]`` stacks whose
    frame counts may differ. Equal stacks merge as a batched field does (``[N, frames, C, H,
    W]``); unequal ones into a list of them, as vLLM hands them to its model (the device stage
    takes their frames concatenated and :meth:`finish` splits them again)."""

    kind: FieldKind = FieldKind.BATCHED
    modality: str = "video"

    def merge(self, values: Sequence[Any]) -> Any:
        if _same_shapes(values):
            return super().merge(values)
        return list(values)

    def concat_parts(self, values: Sequence[Any]) -> list[torch.Tensor] | None:
        if _same_shapes(values):
            return super().concat_parts(values)
        return [torch.as_tensor(v) for v in values]

    def finish(self, batch: torch.Tensor, values: Sequence[Any]) -> Any:
        if _same_shapes(values):
            return batch
        return list(torch.split(batch, [int(v.shape[0]) for v in values]))


def _same_shapes(values: Sequence[Any]) -> bool:
    return len({tuple(getattr(v, "shape", ())) for v in values}) <= 1


# -------------------------------------------------------------------------- offline builder

#: llava-hf/llava-v1.6-mistral-7b-hf's preprocessor_config.json and processor_config.json
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAVA_NEXT_IMAGE_PARAMS: dict[str, Any] = {
    "size": {"shortest_edge": 336},
    "crop_size": {"height": 336, "width": 336},
    "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "do_center_crop": True,
    "do_pad": True,
}
LLAVA_NEXT_PROCESSOR_PARAMS: dict[str, Any] = {
    "patch_size": 14,
    "vision_feature_select_strategy": "default",
    "num_additional_image_tokens": 1,
}


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``LlavaNextProcessor`` of LLaVA-NeXT (Mistral 7B), with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.LlavaNextImageProcessor,
        "pil": transformers.LlavaNextImageProcessorPil,
    }[backend]
    tokenizer = build_tokenizer(LLAVA_NEXT_SPECIAL_TOKENS, eos_token="</s>")
    return transformers.LlavaNextProcessor(
        image_processor=image_cls(**{**LLAVA_NEXT_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        **LLAVA_NEXT_PROCESSOR_PARAMS,
    )


# ---------------------------------------------------------------------------- the processor


@dataclass(frozen=True)
class _TransformParams:
    resample: Resample
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


def _size_get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)


@register(
    Architecture(
        "llava-next", "LlavaNextForConditionalGeneration", build_hf_processor,
        "llava-hf/llava-v1.6-mistral-7b-hf",
    )
)  # fmt: skip
class LlavaNextMultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of LLaVA-NeXT (``LlavaNextProcessor``), images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW
    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    # vLLM's LLaVA-NeXT takes normalised pixels (no mm_device_do_normalize support)
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        self.image_token_id = int(hf_processor.image_token_id)
        ip = self.image_processor
        self.pinpoints: list[list[int]] = [[int(h), int(w)] for h, w in ip.image_grid_pinpoints]
        size, crop = ip.size, ip.crop_size
        edge = _size_get(size, "shortest_edge")
        base = (edge, edge) if edge else (_size_get(size, "height"), _size_get(size, "width"))
        self.base_size: tuple[int, int] = (int(base[0]), int(base[1]))
        crop_h = _size_get(crop, "height") if crop else None
        self.patch = int(crop_h or base[0])
        # The patches are cut at crop size and the base resized to ``size``; HF then resizes
        # each to ``size`` and centre-crops it to ``crop_size``, which keeps them as they are
        # only when all three agree (as every published checkpoint has them).
        if not (self.base_size == (self.patch, self.patch) and (not crop or (
            _size_get(crop, "height"), _size_get(crop, "width")) == (self.patch, self.patch)
        )):  # fmt: skip
            raise ConfigError(
                f"{type(self).__name__} needs size and crop_size of one square side, got "
                f"size={dict(size) if isinstance(size, Mapping) else size}, crop_size={crop}"
            )
        #: features per side of one ``patch`` (the vision tower's patch grid)
        self.npatches, self.base_features = self._feature_grid(hf_processor)
        #: the grid's features are scaled down to about this many patches' (OneVision)
        self.max_patches: int | None = None

    def _feature_grid(self, hf_processor: Any) -> tuple[int, int]:
        """Features per side of a patch, and the base image's features: CLIP's patches and its
        CLS, which the "default" feature selection drops (vLLM's
        ``get_num_selected_vision_tokens``)."""
        npatches = self.patch // int(hf_processor.patch_size)
        extra = int(getattr(hf_processor, "num_additional_image_tokens", 0) or 0)
        default = hf_processor.vision_feature_select_strategy == "default"
        return npatches, npatches**2 + extra - int(default)

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads and vLLM's count allows."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        return resolve_params(_TransformParams, self.image_processor, hf_kwargs)

    # the transform --------------------------------------------------------------------------

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of an image's grid patches (the base image not counted)."""
        return anyres_grid(height, width, self.pinpoints, self.patch)

    def patch_image(self, image: Any, params: _TransformParams) -> torch.Tensor:
        """One image -> its uint8 patches ``[1 + rows * cols, 3, patch, patch]``, base first."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        height, width = rgb.shape[:2]
        rows, cols = self.grid(height, width)
        p = self.patch
        best_h, best_w = rows * p, cols * p
        new_h, new_w = fit_size(height, width, best_h, best_w)
        out = torch.zeros((1 + rows * cols, 3, p, p), dtype=torch.uint8)
        fitted = resize(rgb, new_h, new_w, params.resample, self.backend)
        canvas = torch.zeros((3, best_h, best_w), dtype=torch.uint8)
        top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
        canvas[:, top : top + new_h, left : left + new_w] = fitted
        out[1:] = canvas.reshape(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
        out[0] = resize(rgb, *self.base_size, params.resample, self.backend)
        return out

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        images = hf_data.get("images", [])
        if not images:
            return {}
        sizes = [list(image_size(image)) for image in images]
        stacks = [self.patch_image(image, params) for image in images]
        if not self.device_normalize:
            stacks = [self._cpu_normalize_tiles(stack, params) for stack in stacks]
        # Unpadded: the field config splits a list of stacks as it splits HF's padded batch.
        return {"pixel_values": stacks, "image_sizes": torch.tensor(sizes, dtype=torch.long)}

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        return planned_item("image", image_sizes=[height, width])

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        stacks = data.pop("pixel_values", None)
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        if stacks is None:
            return data
        if isinstance(stacks, list):  # the native transform's unpadded stacks
            stacks = [torch.as_tensor(stack) for stack in stacks]
            if self.device_normalize:
                stacks = [check_uint8_exact("pixel_values", stack) for stack in stacks]
        else:
            stacks = torch.as_tensor(stacks)
            if self.device_normalize:
                stacks = check_uint8_exact("pixel_values", stacks)
        data["pixel_values"] = stacks
        return data

    # fields, updates --------------------------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        sizes = outputs.get("image_sizes")
        pairs = [(int(h), int(w)) for h, w in (sizes.tolist() if sizes is not None else [])]
        counts = tuple(1 + math.prod(self.grid(h, w)) for h, w in pairs)
        return {
            "pixel_values": PaddedPatchesField(counts=counts),
            "image_sizes": MultiModalFieldConfig.batched("image"),
        }

    def num_image_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens of a ``height x width`` image (vLLM's
        ``get_num_image_tokens``)."""
        rows, cols = self.grid(height, width)
        unpadded, newline = unpadded_features(
            height, width, self.npatches, rows, cols, max_patches=self.max_patches
        )
        return unpadded + newline + self.base_features

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])

        def replacement(i: int) -> PromptUpdateDetails:
            height, width = (int(v) for v in items[i].data["image_sizes"])
            tokens = [self.image_token_id] * self.num_image_tokens(height, width)
            return PromptUpdateDetails.from_seq(tokens)

        return [PromptReplacement("image", [self.image_token_id], replacement)]


# ------------------------------------------------------------------------------- OneVision

VIDEO_PLACEHOLDER = "<video>"
ONEVISION_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER,
)  # fmt: skip
#: llava-hf/llava-onevision-qwen2-7b-ov-hf's grid: 1 to 6 patches of 384 a side
ONEVISION_PINPOINTS = [[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]
#: its preprocessor_config.json (SigLIP at 384 px) and processor_config.json
ONEVISION_IMAGE_PARAMS: dict[str, Any] = {
    "size": {"height": 384, "width": 384},
    "image_grid_pinpoints": ONEVISION_PINPOINTS,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "do_pad": True,
}
ONEVISION_PROCESSOR_PARAMS: dict[str, Any] = {
    "num_image_tokens": 729,
    "vision_feature_select_strategy": "full",
    "vision_aspect_ratio": "anyres_max_9",
}


def build_onevision_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``LlavaOnevisionProcessor`` of LLaVA-OneVision (Qwen2 7B), with a tokenizer built in
    code."""
    import transformers

    image_cls = {
        "torchvision": transformers.LlavaOnevisionImageProcessor,
        "pil": transformers.LlavaOnevisionImageProcessorPil,
    }[backend]
    tokenizer = build_tokenizer(ONEVISION_SPECIAL_TOKENS, eos_token="<|im_end|>")
    return transformers.LlavaOnevisionProcessor(
        image_processor=image_cls(**{**ONEVISION_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        video_processor=transformers.LlavaOnevisionVideoProcessor(
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
        ),
        **ONEVISION_PROCESSOR_PARAMS,
    )


@register(
    Architecture(
        "llava-onevision", "LlavaOnevisionForConditionalGeneration", build_onevision_processor,
        "llava-hf/llava-onevision-qwen2-7b-ov-hf",
    )
)  # fmt: skip
class LlavaOnevisionMultiModalProcessor(LlavaNextMultiModalProcessor):
    """Processor of LLaVA-OneVision (``LlavaOnevisionProcessor``), images and videos: LLaVA-NeXT's
    anyres transform on SigLIP's 384 px patches (no crop, mean/std 0.5), and its
    ``anyres_max_9`` count: a grid of more than about 9 patches' features is scaled down to that
    many. A video item is a :class:`~aiomm.media.video.VideoClip` (or ``T x H x W x 3`` frames),
    every frame of it taken (module docstring)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video")
    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
    )

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        aspect = str(getattr(hf_processor, "vision_aspect_ratio", "") or "")
        if not aspect.startswith("anyres_max_"):
            raise ConfigError(f"{type(self).__name__} needs anyres_max_N, got {aspect!r}")
        self.max_patches = int(aspect.removeprefix("anyres_max_"))
        self.video_processor: Any = hf_processor.video_processor
        if self.video_processor is None:
            raise ConfigError(f"{type(self).__name__} needs the processor's video_processor")
        self.video_token_id = int(hf_processor.video_token_id)
        size = self.video_processor.size
        self.frame_size = (int(_size_get(size, "height")), int(_size_get(size, "width")))
        #: features per frame: the patch grid average-pooled with stride 2 (vLLM's
        #: ``_get_num_frame_tokens``; HF's ``replace_video_token``)
        self.frame_features = math.ceil(self.npatches / 2) ** 2

    # videos -----------------------------------------------------------------------------------

    def sample_frames(self, info: VideoInfo, hf_kwargs: Mapping[str, Any]) -> list[int]:
        """Every frame of a video of ``info``: HF's OneVision video processor samples none
        (``do_sample_frames`` off; vLLM's render server samples with its loader instead)."""
        return list(range(info.total_num_frames))

    def _resolve_video_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        return resolve_params(_TransformParams, self.video_processor, hf_kwargs)

    def transform_video(self, frames: np.ndarray, params: _TransformParams) -> torch.Tensor:
        """``T x H x W x 3`` uint8 frames -> ``[T, 3, height, width]`` as the video processor
        makes them: resized as one batch, normalised (uint8 when the device normalises)."""
        # T x C x H x W with channels-last strides: the resize reads any strides
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        if tuple(video.shape[-2:]) != self.frame_size:
            video = resize_chw(video, *self.frame_size, params.resample)
        if self.device_normalize:
            return video.contiguous()
        return self.video_processor.rescale_and_normalize(
            video.float(), True, params.rescale_factor, True,
            tuple(params.image_mean), tuple(params.image_std),
        ).contiguous()  # fmt: skip

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        if "videos" in hf_data:
            hf_data["videos"] = [
                v.frames if isinstance(v, VideoClip) else np.asarray(v) for v in hf_data["videos"]
            ]
        return hf_data, kwargs, passthrough

    def _call_hf_processor(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        """The HF processor called as vLLM calls it when a request has videos: its images in one
        call, each video in its own (HF cannot stack videos of different lengths)."""
        videos = hf_data.get("videos")
        if self.transform == "native" or not videos:
            return super()._call_hf_processor(hf_data, hf_kwargs)
        out: dict[str, Any] = {}
        if images := hf_data.get("images"):
            text = [IMAGE_PLACEHOLDER * len(images)]
            done = super()._call_hf_processor({"text": text, "images": images}, hf_kwargs)
            out.update({k: done[k] for k in ("pixel_values", "image_sizes")})
        stacks = []
        for frames in videos:
            one = {"text": [VIDEO_PLACEHOLDER], "videos": [frames]}
            stacks.append(super()._call_hf_processor(one, hf_kwargs)["pixel_values_videos"][0])
        out["pixel_values_videos"] = stacks
        return out

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        videos = hf_data.get("videos", [])
        out = dict(super()._call_native_transform(hf_data, hf_kwargs))
        if videos:
            params = self._resolve_video_params(hf_kwargs)
            if self.device_normalize:
                check_device_normalization(self._resolve_params(hf_kwargs), params)
            out["pixel_values_videos"] = [self.transform_video(f, params) for f in videos]
        return out

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        videos = data.pop("pixel_values_videos", None)
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        if videos is not None:
            stacks = [torch.as_tensor(v) for v in videos]  # a list, or HF's batch of one
            if self.device_normalize:
                stacks = [check_uint8_exact("pixel_values_videos", v) for v in stacks]
            data["pixel_values_videos"] = stacks
        return data

    def plan_video(self, video: SampledVideo, hf_kwargs: Mapping[str, Any]) -> MultiModalKwargsItem:
        return planned_item("video", {"num_frames": video.num_frames})

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        fields = super()._get_mm_fields_config(outputs, hf_kwargs)
        if "pixel_values_videos" in outputs:
            fields["pixel_values_videos"] = VideoFramesField()
        return fields

    def num_video_tokens(self, num_frames: int) -> int:
        """The placeholder tokens of a video of ``num_frames`` frames (vLLM's
        ``get_num_video_tokens``): the pooled features of every frame and one newline."""
        return self.frame_features * num_frames + 1

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        updates = super()._get_prompt_updates(mm_counts, hf_kwargs, mm_kwargs)
        videos = mm_kwargs.get("video", [])

        def replacement(i: int) -> PromptUpdateDetails:
            item = videos[i]
            pixels = item.data.get("pixel_values_videos")
            frames = item.prompt_data["num_frames"] if pixels is None else int(pixels.shape[0])
            tokens = [self.video_token_id] * self.num_video_tokens(frames)
            return PromptUpdateDetails.from_seq(tokens)

        updates.append(PromptReplacement("video", [self.video_token_id], replacement))
        return updates

    def _feature_grid(self, hf_processor: Any) -> tuple[int, int]:
        """SigLIP has no CLS: the base image's features are ``num_image_tokens``, a square."""
        base = int(hf_processor.num_image_tokens)
        npatches = math.isqrt(base)
        if hf_processor.vision_feature_select_strategy == "default":
            base -= 1
        return npatches, base
