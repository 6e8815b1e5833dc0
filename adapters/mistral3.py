"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1/3.2), images.

Reference: transformers' ``PixtralProcessor`` with ``PixtralImageProcessor`` (torchvision backend)
or ``PixtralImageProcessorPil`` (PIL backend), as the checkpoints configure them: vision patch 14,
``spatial_merge_size`` 2 (the processor passes ``patch_size * spatial_merge_size`` = 28 to the
image processor, overriding its own ``patch_size``), ``longest_edge`` 1540, CLIP mean/std.

The transform: scale down (never up) to fit ``longest_edge``, floor the sides, round each side up
to a multiple of the patch (so the bicubic resize may enlarge a little), rescale/normalise. Each
``[IMG]`` becomes ``rows`` runs of ``[IMG] * cols + [IMG_BREAK]`` with the last token replaced by
``[IMG_END]``; only the ``[IMG]`` tokens take embeddings (``is_embed``).

Padding. HF pads a batch to its largest image (bottom and right, with zeros, after normalising).
Here each item holds its own image, ``[C, h, w]`` cropped to ``image_sizes``, so a cached item
never depends on the batch it was processed in; merging items (:class:`PaddedImageField`) pads
them to the largest again and stacks, which reproduces HF's ``[N, C, H, W]`` batch exactly: bit for
bit in uint8, and equal to HF's float batch on the classic CPU path. With
``mm_device_do_normalize`` on, the engine puts HF's 0.0 back into the padding after the device
stage (``PaddedImageField.finish``); a caller normalising ``merged_kwargs()`` itself gets
``-mean / std`` there, which the model never reads (it crops every image to its
``image_sizes``). The ``native`` transform is proven equal to ``hf`` bit for bit for both
backends by tests/adapters/test_parity.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import EmptyResizeError, ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import (
    FieldConfig,
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    PaddedImageField,
)
from aiomm.processing.image_ops import Resample, resize, to_rgb_array
from aiomm.processing.processor import (
    BaseMultiModalProcessor,
    check_uint8_exact,
    image_size,
    planned_item,
)
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = ("Mistral3MultiModalProcessor", "pixtral_target_size")

MISTRAL3_SPECIAL_TOKENS = (
    "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
    "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip
IMAGE_PLACEHOLDER = "[IMG]"

# Kwargs of PixtralImageProcessor that the transform reads. ``patch_size`` is left out: the
# processor overrides it with its own ``patch_size * spatial_merge_size``.
_KWARGS = frozenset({
    "do_resize", "size", "resample", "do_convert_rgb", "rescale_factor", "image_mean", "image_std",
})  # fmt: skip


def pixtral_target_size(
    height: int, width: int, *, max_height: int, max_width: int, patch_size: int
) -> tuple[int, int]:
    """Pixtral's resize target, identical to transformers' ``get_resize_output_image_size``.

    :raises EmptyResizeError: an image so thin that scaling it down to fit floors a side to
        zero pixels (HF's resize would then fail in torch or Pillow).
    """
    source = height, width
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height = math.floor(height / ratio)
        width = math.floor(width / ratio)
    rows, cols = (height - 1) // patch_size + 1, (width - 1) // patch_size + 1
    if rows <= 0 or cols <= 0:
        raise EmptyResizeError("image", *source, (rows * patch_size, cols * patch_size))
    return rows * patch_size, cols * patch_size


# -------------------------------------------------------------------------- offline builder

# mistralai/Mistral-Small-3.1-24B-Instruct-2503's processor_config.json and
# preprocessor_config.json.
MISTRAL3_PROCESSOR_PARAMS: dict[str, Any] = {"patch_size": 14, "spatial_merge_size": 2}
MISTRAL3_IMAGE_PARAMS: dict[str, Any] = {
    "patch_size": {"height": 14, "width": 14},
    "size": {"longest_edge": 1540},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``PixtralProcessor`` of Mistral Small 3.1, with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.PixtralImageProcessor,
        "pil": transformers.PixtralImageProcessorPil,
    }[backend]
    tokenizer = build_tokenizer(MISTRAL3_SPECIAL_TOKENS, eos_token="</s>")
    return transformers.PixtralProcessor(
        image_processor=image_cls(**{**MISTRAL3_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        **MISTRAL3_PROCESSOR_PARAMS,
    )


@dataclass(frozen=True)
class _TransformParams:
    max_height: int
    max_width: int
    patch_size: int
    resample: Resample
    do_resize: bool
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


@register(
    Architecture(
        "mistral3", "Mistral3ForConditionalGeneration", build_hf_processor,
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
    )
)  # fmt: skip
class Mistral3MultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of Mistral 3 (``PixtralProcessor``), images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        self.image_token_id = int(hf_processor.image_token_id)
        self.image_break_token_id = int(hf_processor.image_break_token_id)
        self.image_end_token_id = int(hf_processor.image_end_token_id)
        #: the patch the processor imposes on the image processor (and counts tokens with)
        self.patch_size = int(hf_processor.patch_size) * int(hf_processor.spatial_merge_size)

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads; others would be ignored."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        ip = self.image_processor
        size = hf_kwargs.get("size", ip.size)
        size_get: Callable[..., Any] = (
            size.get if isinstance(size, Mapping) else lambda k, d=None: getattr(size, k, d)
        )
        if size_get("longest_edge", None):
            max_height = max_width = int(size_get("longest_edge"))
        elif size_get("height", None) and size_get("width", None):
            max_height, max_width = int(size_get("height")), int(size_get("width"))
        else:
            raise ProcessorKwargsError(
                "Pixtral needs size={'longest_edge': n} or size={'height': h, 'width': w}"
            )
        # patch_size is the processor's (it overrides the image processor's), never a kwarg.
        return resolve_params(
            _TransformParams, ip, hf_kwargs,
            max_height=max_height, max_width=max_width, patch_size=self.patch_size,
        )  # fmt: skip

    # the transform --------------------------------------------------------------------------

    def target_size(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        if not params.do_resize:
            return height, width
        return pixtral_target_size(
            height,
            width,
            max_height=params.max_height,
            max_width=params.max_width,
            patch_size=params.patch_size,
        )

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        if self.transform == "hf" and hf_data.get("images"):
            # refused typed before HF's resize fails on it (the native transform refuses as it
            # computes each image's size)
            params = self._resolve_params(kwargs)
            for image in hf_data["images"]:
                self.target_size(*image_size(image), params)
        return hf_data, kwargs, passthrough

    def transform_image(self, image: Any, params: _TransformParams) -> torch.Tensor:
        """One image -> its ``[C, h, w]`` pixels (uint8, or normalised on the classic path).

        :raises EmptyResizeError: an image too thin to keep a pixel on each side.
        """
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        height, width = self.target_size(rgb.shape[0], rgb.shape[1], params)
        chw = resize(rgb, height, width, params.resample, self.backend).contiguous()
        return chw if self.device_normalize else self._cpu_normalize(chw, params)

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        images = [self.transform_image(image, params) for image in hf_data.get("images", [])]
        if not images:
            return {}
        sizes = [[int(x.shape[-2]), int(x.shape[-1])] for x in images]
        # Unpadded: the field config splits a list of images as it splits HF's padded batch.
        return {"pixel_values": images, "image_sizes": torch.tensor(sizes, dtype=torch.long)}

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        height, width = self.target_size(height, width, self._resolve_params(hf_kwargs))
        return planned_item("image", image_sizes=[height, width])

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        images = data.pop("pixel_values", None)
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        if images is None:
            return data
        if isinstance(images, list):  # the native transform's unpadded images
            images = [torch.as_tensor(image) for image in images]
            if self.device_normalize:
                images = [check_uint8_exact("pixel_values", image) for image in images]
        else:
            images = torch.as_tensor(images)
            if self.device_normalize:
                images = check_uint8_exact("pixel_values", images)
        data["pixel_values"] = images
        return data

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        sizes = outputs.get("image_sizes")
        pairs = tuple((int(h), int(w)) for h, w in (sizes.tolist() if sizes is not None else []))
        return {
            "pixel_values": PaddedImageField("image", pairs),
            "image_sizes": MultiModalFieldConfig.batched("image"),
        }

    def image_tokens(self, item: MultiModalKwargsItem) -> list[int]:
        """The tokens of one image: rows of ``[IMG] * cols + [IMG_BREAK]``, ending ``[IMG_END]``."""
        height, width = (int(v) for v in item.data["image_sizes"])
        rows, cols = height // self.patch_size, width // self.patch_size
        tokens = ([self.image_token_id] * cols + [self.image_break_token_id]) * rows
        if tokens:
            tokens[-1] = self.image_end_token_id
        return tokens

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])

        def replacement(i: int) -> PromptUpdateDetails:
            return PromptUpdateDetails.select_token_id(
                self.image_tokens(items[i]), self.image_token_id
            )

        return [PromptReplacement("image", [self.image_token_id], replacement)]
