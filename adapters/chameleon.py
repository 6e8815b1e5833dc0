"""Chameleon (``ChameleonForConditionalGeneration``), images.

Reference: transformers' ``ChameleonProcessor`` with ``ChameleonImageProcessor`` (torchvision
backend) or ``ChameleonImageProcessorPil`` (PIL backend), at their defaults (those of
``facebook/chameleon-7b``): Lanczos resize of the shortest edge to 512, centre crop to 512x512,
``x * 0.0078`` then mean 1 / std 1 (so ``x * 0.0078 - 1``), ``pixel_values`` ``[N, 3, 512, 512]``.

Each ``<image>`` becomes ``<racm3:break> + <image> * image_seq_length (1024) + <eoss>``; only the
``<image>`` tokens take embeddings (``is_embed``). In chat mode (the processor's default,
``return_for_text_completion=False``) the processor appends the tokenizer's ``sep_token``
(``<reserved08706>``) to the prompt; ``_postprocess_prompt`` does the same to the token ids, always
(text-completion mode is not offered). ``ChameleonProcessor.__call__`` needs text, so the
transform calls it with the dummy text. vLLM takes one image per prompt for Chameleon; the adapter
itself does not limit the count.

``mm_device_do_normalize`` is off by default for Chameleon. The ``native`` transform (Pillow's
Lanczos for the PIL backend, ``torch``'s uint8 Lanczos ``interpolate`` kernel, which
torchvision's ``resize`` dispatches to, for the torchvision backend) is proven equal to ``hf`` bit
for bit for both backends by tests/adapters/test_parity.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessingError, ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import Backend, Resample, resize, to_rgb_array
from aiomm.processing.processor import BaseMultiModalProcessor, planned_item
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = ("ChameleonMultiModalProcessor", "center_crop", "shortest_edge_size")

CHAMELEON_SPECIAL_TOKENS = ("<s>", "</s>", "<image>", "<racm3:break>", "<eoss>", "<reserved08706>")
SEP_TOKEN = "<reserved08706>"
IMAGE_PLACEHOLDER = "<image>"

# Kwargs of ChameleonImageProcessor that the transform reads; others would be ignored.
_KWARGS = frozenset({
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_convert_rgb",
    "rescale_factor", "image_mean", "image_std",
})  # fmt: skip


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """Scale the shorter side to ``shortest_edge`` (the longer one truncated), as transformers'
    ``get_resize_output_image_size`` does without ``max_size``."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(chw: torch.Tensor, height: int, width: int, backend: Backend) -> torch.Tensor:
    """Crop the centre ``height x width`` of a ``C x H x W`` tensor, padding with zeros.

    An image smaller than the crop is padded around its centre; for an odd difference the
    torchvision backend puts the extra pixel after the image, the PIL backend before it.
    """

    def place(size: int, crop: int) -> tuple[int, int, int]:  # (source, destination, length)
        if crop <= size:
            return (size - crop) // 2, 0, crop
        gap = crop - size
        return 0, (gap // 2 if backend is Backend.TORCHVISION else math.ceil(gap / 2)), size

    sy, dy, lh = place(int(chw.shape[-2]), height)
    sx, dx, lw = place(int(chw.shape[-1]), width)
    crop = chw[..., sy : sy + lh, sx : sx + lw]
    if (lh, lw) == (height, width):
        return crop.contiguous()
    out = chw.new_zeros((*chw.shape[:-2], height, width))
    out[..., dy : dy + lh, dx : dx + lw] = crop
    return out


# -------------------------------------------------------------------------- offline builder


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``ChameleonProcessor`` at its defaults, with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.ChameleonImageProcessor,
        "pil": transformers.ChameleonImageProcessorPil,
    }[backend]
    tokenizer = build_tokenizer(CHAMELEON_SPECIAL_TOKENS, eos_token="</s>")
    tokenizer.sep_token = SEP_TOKEN
    return transformers.ChameleonProcessor(image_cls(**overrides), tokenizer)


@dataclass(frozen=True)
class _TransformParams:
    size: tuple[str, int, int]  # ("shortest_edge", n, n) or ("exact", height, width)
    crop: tuple[int, int]
    resample: Resample
    do_resize: bool
    do_center_crop: bool
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


def _resize(
    image: np.ndarray, height: int, width: int, resample: Resample, backend: Backend
) -> Any:
    if backend is Backend.TORCHVISION and resample is Resample.LANCZOS:
        # image_ops has no Lanczos for this backend: torchvision's resize runs torch's uint8
        # Lanczos kernel on the CPU (antialiased), which is this call.
        chw = torch.from_numpy(np.array(np.moveaxis(image, -1, 0), order="C"))
        if (chw.shape[-2], chw.shape[-1]) == (height, width):
            return chw
        return F.interpolate(
            chw.unsqueeze(0), size=(height, width), mode="lanczos", align_corners=False,
            antialias=True,
        )[0]  # fmt: skip
    return resize(image, height, width, resample, backend)


@register(
    Architecture(
        "chameleon", "ChameleonForConditionalGeneration", build_hf_processor,
        "facebook/chameleon-7b",
    )
)  # fmt: skip
class ChameleonMultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of Chameleon (``ChameleonProcessor``), images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        self.image_token_id = int(hf_processor.image_token_id)
        self.image_start_token_id = int(hf_processor.image_start_token_id)
        self.image_end_token_id = int(hf_processor.image_end_token_id)
        self.image_seq_length = int(hf_processor.image_seq_length)
        tokenizer = hf_processor.tokenizer
        if tokenizer.sep_token is None:
            raise ProcessingError("Chameleon's tokenizer has no sep_token to end a chat prompt")
        self.sep_token_id = int(tokenizer.convert_tokens_to_ids(tokenizer.sep_token))

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads; others would be ignored."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        from transformers.image_processing_utils import get_size_dict

        ip = self.image_processor
        get = hf_kwargs.get
        size = dict(get_size_dict(get("size", ip.size), default_to_square=ip.default_to_square))
        if size.get("shortest_edge") and not size.get("longest_edge"):
            target = ("shortest_edge", int(size["shortest_edge"]), int(size["shortest_edge"]))
        elif size.get("height") and size.get("width"):
            target = ("exact", int(size["height"]), int(size["width"]))
        else:
            raise ProcessorKwargsError(
                f"Chameleon's transform takes size={{'shortest_edge': n}} or "
                f"{{'height': h, 'width': w}}, got {size}"
            )
        crop = dict(get_size_dict(get("crop_size", ip.crop_size), param_name="crop_size"))
        return resolve_params(
            _TransformParams, ip, hf_kwargs,
            size=target, crop=(int(crop["height"]), int(crop["width"])),
        )  # fmt: skip

    # the transform --------------------------------------------------------------------------

    def target_size(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        if not params.do_resize:
            return height, width
        kind, a, b = params.size
        return shortest_edge_size(height, width, a) if kind == "shortest_edge" else (a, b)

    def transform_image(self, image: Any, params: _TransformParams) -> torch.Tensor:
        """One image -> its ``[C, H, W]`` pixels (uint8, or normalised on the classic path)."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        height, width = self.target_size(rgb.shape[0], rgb.shape[1], params)
        chw = _resize(rgb, height, width, params.resample, self.backend)
        if params.do_center_crop:
            chw = center_crop(chw, *params.crop, self.backend)
        return chw if self.device_normalize else self._cpu_normalize(chw, params)

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        images = [self.transform_image(image, params) for image in hf_data.get("images", [])]
        if not images:
            return {}
        if len({tuple(x.shape) for x in images}) != 1:
            raise ProcessingError(
                "Chameleon's images differ in size (do_center_crop off?): "
                f"{[tuple(x.shape) for x in images]}; HF cannot batch them either"
            )
        return {"pixel_values": torch.stack(images)}

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        # the size decides no token (a fixed count): computed for what it would refuse
        self.target_size(height, width, self._resolve_params(hf_kwargs))
        return planned_item("image")

    # prompt, fields, updates, normalisation -------------------------------------------------

    def _postprocess_prompt(self, token_ids: list[int]) -> list[int]:
        # ChameleonProcessor appends sep_token to the text in chat mode (its default).
        return [*token_ids, self.sep_token_id]

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        return {"pixel_values": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        tokens = [
            self.image_start_token_id,
            *[self.image_token_id] * self.image_seq_length,
            self.image_end_token_id,
        ]
        content = PromptUpdateDetails.select_token_id(tokens, self.image_token_id)
        return [PromptReplacement("image", [self.image_token_id], content)]
