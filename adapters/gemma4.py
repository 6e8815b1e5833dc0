"""Gemma 4 (``Gemma4ForConditionalGeneration``), images.

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

Videos and audio are not handled (refused as unsupported modalities).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessorKwargsError
from aiomm.kernels import ChannelLayout
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
    "Gemma4MultiModalProcessor",
    "gemma4_num_soft_tokens",
    "gemma4_target_size",
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
    """Processor of Gemma 4 (``Gemma4Processor``), images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.PATCHES

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
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
        if not per_image:
            return {}
        return {
            "pixel_values": torch.stack([pv for pv, _ in per_image]),
            "pixel_position_ids": torch.stack([pos for _, pos in per_image]),
        }

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        # vLLM's names; the soft-token counts are the prompt's (counted from the image sizes)
        data.pop("num_soft_tokens_per_image", None)
        if "image_position_ids" in data:
            data["pixel_position_ids"] = data.pop("image_position_ids")
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        if "pixel_values" in data and self.device_normalize:
            data["pixel_values"] = check_uint8_exact("pixel_values", data["pixel_values"])
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
        return {
            "pixel_values": MultiModalFieldConfig.batched("image"),
            "pixel_position_ids": MultiModalFieldConfig.batched("image"),
        }

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

        def replacement(i: int) -> PromptUpdateDetails:
            return self.image_tokens(int(items[i].prompt_data["tokens"]))

        return [PromptReplacement("image", [self.image_token_id], replacement)]
