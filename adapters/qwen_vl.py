"""The Qwen-VL family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), Qwen4-Exp; Intern-S.

Reference: transformers' ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` with
``Qwen2VLImageProcessor`` (torchvision backend) or ``Qwen2VLImageProcessorPil`` (PIL backend),
which every member uses for images. Images only: video is not supported yet.

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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params, size_edges
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessingError, ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import (
    Backend,
    ReducedImage,
    Resample,
    as_tensor_view,
    patchify,
    resize,
    to_rgb_array,
)
from aiomm.processing.processor import BaseMultiModalProcessor
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "QwenVLProcessor",
    "grid_fields_config",
    "grid_outputs",
    "grid_prompt_updates",
    "smart_resize",
)

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The target (height, width) of Qwen-VL's resize, identical to transformers' ``smart_resize``.

    :raises ProcessingError: for an aspect ratio above 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ProcessingError(
            f"image of {height}x{width} has an aspect ratio above 200, which Qwen-VL rejects"
        )
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
    return h_bar, w_bar


def grid_outputs(transformed: list[tuple[torch.Tensor, list[int]]]) -> dict[str, Any]:
    """Per-image (rows, grid) pairs -> ``pixel_values`` rows and ``image_grid_thw``."""
    if not transformed:
        return {}
    rows = [r for r, _ in transformed]
    return {
        "pixel_values": rows[0] if len(rows) == 1 else torch.cat(rows),
        "image_grid_thw": torch.tensor([g for _, g in transformed], dtype=torch.long),
    }


def grid_prompt_updates(token: int, tokens_of: Callable[[int], int]) -> list[PromptUpdate]:
    """Image ``i``'s placeholder token becomes ``tokens_of(i)`` copies of itself."""

    def replacement(i: int) -> PromptUpdateDetails:
        return PromptUpdateDetails.from_seq([token] * tokens_of(i))

    return [PromptReplacement("image", [token], replacement)]


def grid_fields_config(
    outputs: Mapping[str, Any], *, repeat: tuple[int, int] | None = None
) -> dict[str, MultiModalFieldConfig]:
    """Items of grid-patch processors: ``prod(grid_thw)`` rows each, one grid each.

    ``repeat``: the rows are compact (one frame) and merge into the model's rows by repeating
    each of their ``repeat[0]`` channel blocks ``repeat[1]`` times.
    """
    grid = outputs.get("image_grid_thw")
    sizes = grid.prod(-1) if grid is not None else []
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
    """Processor of every Qwen-VL family architecture (images)."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.PATCHES

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    has_native: ClassVar[bool] = True
    supports_device_resize: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        self.image_token_id: int = int(hf_processor.image_token_id)

    # kwargs ---------------------------------------------------------------------------------

    def max_kept_pixels(self) -> int | None:
        """``size.longest_edge``: smart_resize keeps at most that many pixels."""
        _, longest = size_edges(self.hf_processor.image_processor.size)
        return None if longest is None else int(longest)

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        ip = self.image_processor
        shortest, longest = size_edges(hf_kwargs.get("size", ip.size))
        shortest = hf_kwargs.get("min_pixels", shortest)
        longest = hf_kwargs.get("max_pixels", longest)
        if not shortest or not longest:
            raise ProcessorKwargsError(
                "Qwen-VL needs size={'shortest_edge': min_pixels, 'longest_edge': max_pixels}"
            )
        return resolve_params(
            _TransformParams, ip, hf_kwargs, min_pixels=int(shortest), max_pixels=int(longest)
        )

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        # min_pixels/max_pixels at call time are deprecated in transformers: pass them as size.
        if "min_pixels" in kwargs or "max_pixels" in kwargs:
            params = self._resolve_params(kwargs)
            kwargs.pop("min_pixels", None)
            kwargs.pop("max_pixels", None)
            kwargs["size"] = {"shortest_edge": params.min_pixels, "longest_edge": params.max_pixels}
        return hf_data, kwargs, passthrough

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
            chw = resize(rgb, height, width, params.resample, self.backend)
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

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        return grid_outputs([self.transform_image(i, params) for i in hf_data.get("images", [])])

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        if self.transform != "native" or "pixel_values" not in outputs:
            return grid_fields_config(outputs)
        params = self._resolve_params(hf_kwargs)
        channels = outputs["pixel_values"].shape[-1] // params.patch_size**2
        return grid_fields_config(outputs, repeat=(channels, params.temporal_patch_size))

    def num_image_tokens(self, item: MultiModalKwargsItem, hf_kwargs: Mapping[str, Any]) -> int:
        merge = int(hf_kwargs.get("merge_size", self.image_processor.merge_size))
        return int(item.data["image_grid_thw"].prod()) // (merge * merge)

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        return grid_prompt_updates(
            self.image_token_id, lambda i: self.num_image_tokens(items[i], hf_kwargs)
        )
