"""PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``), images.

Reference: transformers' ``PaddleOCRVLProcessor`` with ``PaddleOCRVLImageProcessor`` (torchvision
backend) or ``PaddleOCRVLImageProcessorPil`` (PIL backend), as ``PaddlePaddle/PaddleOCR-VL``'s
``preprocessor_config.json`` sets them: 147384 .. 2822400 pixels, patch 14, merge 2, one frame
per temporal patch, mean/std 0.5, bicubic. vLLM 0.33 serves the architecture with
``PaddleOCRVLMultiModalProcessor`` (``vllm/model_executor/models/paddleocr_vl.py``), which calls
that HF processor.

The transform (NaViT-style dynamic resolution), per image:

1. :func:`smart_resize`: a side shorter than ``factor = patch_size * merge_size`` is first scaled
   up to ``factor`` (the other side scaled by the same ratio, rounded), then Qwen-VL's rule
   (:func:`aiomm.adapters.qwen_vl.smart_resize`): multiples of ``factor`` within the pixel bounds;
2. bicubic resize, rescale/normalise (on the CPU: vLLM's model takes normalised pixels and has no
   ``mm_device_do_normalize``; with it on here, the patches stay uint8, NCHW);
3. ``pixel_values`` of ``grid_h * grid_w`` patches ``[C * temporal_patch_size, P, P]`` in raster
   order (not grouped by merge window, unlike Qwen-VL), ``image_grid_thw`` ``[1, gh, gw]``.

Each ``<|IMAGE_PLACEHOLDER|>`` becomes ``gh * gw / merge_size**2`` of them (HF's count with the
processor's ``merge_size``; vLLM's with the vision config's ``spatial_merge_size``, the same);
the ``<|IMAGE_START|>``/``<|IMAGE_END|>`` around it stay. Items are laid out as vLLM sends them:
``pixel_values`` flat over the image's patches, ``image_grid_thw`` batched and kept on the CPU.
Neither transformers nor vLLM takes videos for this architecture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.qwen_vl import QwenVLProcessor, grid_fields_config
from aiomm.adapters.qwen_vl import smart_resize as qwen_smart_resize
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import AspectRatioError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import ReducedImage, patchify, resize, to_rgb_array

__all__ = (
    "PADDLEOCR_VL_IMAGE_PARAMS",
    "PaddleOCRVLMultiModalProcessor",
    "build_hf_processor",
    "smart_resize",
)

IMAGE_START = "<|IMAGE_START|>"
IMAGE_TOKEN = "<|IMAGE_PLACEHOLDER|>"
IMAGE_END = "<|IMAGE_END|>"
#: ERNIE 4.5's special tokens the chat template and the config name
PADDLEOCR_VL_SPECIAL_TOKENS = (
    "<s>", "</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>", IMAGE_START, IMAGE_TOKEN,
    IMAGE_END, "<|VIDEO_PLACEHOLDER|>",
)  # fmt: skip
IMAGE_PLACEHOLDER = IMAGE_START + IMAGE_TOKEN + IMAGE_END

#: PaddlePaddle/PaddleOCR-VL's preprocessor_config.json
PADDLEOCR_VL_IMAGE_PARAMS: dict[str, Any] = {
    "min_pixels": 147384,
    "max_pixels": 2822400,
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """The target (height, width) of PaddleOCR-VL's resize, identical to transformers'
    ``paddleocr_vl`` ``smart_resize`` (and vLLM's): a side under ``factor`` is scaled up to it
    first, then Qwen-VL's rule.

    :raises AspectRatioError: an aspect ratio above 200 after scaling a thin side up.
    :raises EmptyResizeError: a target of zero pixels on a side (``min_pixels`` of 0).
    """
    h, w = height, width
    if h < factor:
        w, h = round(w * factor / h), factor
    if w < factor:
        h, w = round(h * factor / w), factor
    ratio = max(h, w) / min(h, w)
    if ratio > 200:
        raise AspectRatioError("image", height, width, ratio=ratio)
    return qwen_smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def build_tokenizer_with_image_token() -> Any:
    """ERNIE 4.5's special tokens on the offline word-level tokenizer, the image token named as
    ``PaddleOCRVLProcessor`` reads it (``tokenizer.image_token``)."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(PADDLEOCR_VL_SPECIAL_TOKENS, eos_token="</s>")
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )  # fmt: skip


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``PaddleOCRVLProcessor`` of PaddleOCR-VL, with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.PaddleOCRVLImageProcessor,
        "pil": transformers.PaddleOCRVLImageProcessorPil,
    }[backend]
    return transformers.PaddleOCRVLProcessor(
        image_processor=image_cls(**{**PADDLEOCR_VL_IMAGE_PARAMS, **overrides}),
        tokenizer=build_tokenizer_with_image_token(),
    )


@register(
    Architecture(
        "paddleocr-vl", "PaddleOCRVLForConditionalGeneration", build_hf_processor,
        "PaddlePaddle/PaddleOCR-VL",
    )
)  # fmt: skip
class PaddleOCRVLMultiModalProcessor(QwenVLProcessor):
    """Processor of PaddleOCR-VL (``PaddleOCRVLProcessor``), images: Qwen-VL's kwargs and plans
    with PaddleOCR-VL's resize rule and patch layout (module docstring)."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW
    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    default_device_normalize: ClassVar[bool] = False
    supports_device_resize: ClassVar[bool] = False

    def target_size(self, height: int, width: int, params: Any) -> tuple[int, int]:
        if not params.do_resize:
            return height, width
        return smart_resize(
            height,
            width,
            factor=params.patch_size * params.merge_size,
            min_pixels=params.min_pixels,
            max_pixels=params.max_pixels,
        )

    def transform_image(self, image: Any, params: Any) -> tuple[torch.Tensor, list[int]]:
        """One image -> (patches ``[gh * gw, C * T, P, P]`` in raster order; [1, gh, gw])."""
        if isinstance(image, ReducedImage):  # fast mode: the target of the source's size
            rgb = image.pixels
            height, width = self.target_size(image.source_height, image.source_width, params)
        else:
            rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
            height, width = self.target_size(rgb.shape[0], rgb.shape[1], params)
        chw = resize(rgb, height, width, params.resample, self.backend, scratch=True)
        if not self.device_normalize:
            chw = self._cpu_normalize(chw, params)
        p, t = params.patch_size, params.temporal_patch_size
        # merge_size 1: rows in raster order, each channel repeated t times, as HF's patchify
        rows = patchify(chw, patch_size=p, merge_size=1, temporal_patch_size=t)
        patches = rows.reshape(rows.shape[0], chw.shape[0] * t, p, p)
        return patches, [1, height // p, width // p]

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        return grid_fields_config(outputs)

    def num_image_tokens(self, item: MultiModalKwargsItem, hf_kwargs: Mapping[str, Any]) -> int:
        # As PaddleOCRVLProcessor.replace_image_token: the processor's merge_size, not a kwarg.
        merge = int(self.image_processor.merge_size)
        return math.prod(item.data["image_grid_thw"].tolist()) // (merge * merge)
