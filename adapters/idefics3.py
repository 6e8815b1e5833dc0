"""Idefics3 (``Idefics3ForConditionalGeneration``), images.

Reference: transformers' ``Idefics3Processor`` with ``Idefics3ImageProcessor`` (torchvision
backend) or ``Idefics3ImageProcessorPil`` (PIL backend), as ``HuggingFaceM4/Idefics3-8B-Llama3``
configures them: the longest edge resized to 1456 (4 x 364), sub-images of 364 px, Lanczos,
mean/std 0.5, 169 ``<image>`` tokens per sub-image (SigLIP patch 14, pixel shuffle 2). vLLM 0.33's
``Idefics3MultiModalProcessor`` (``idefics3.py``) runs that processor and adds ``num_patches``.

The transform, per image (HF's arithmetic, each resize of the previous resize's uint8 pixels):

1. the longest edge to ``size["longest_edge"]`` (up or down; the other side
   ``int()`` of the aspect ratio, made even), capped at 4096 px;
2. with ``do_image_splitting``, both sides to the next multiple of ``max_image_size`` (the long
   side's, then the short side's from the aspect ratio, rounded up); an image larger than one
   sub-image is cut into ``rows x cols`` sub-images of ``max_image_size`` row by row, then the
   whole image resized to one sub-image (the global image) is appended; without splitting, the
   image is resized to one sub-image;
3. rescaled and normalised in float32. Every sub-image is square, so HF's padding adds nothing
   and ``pixel_attention_mask`` is all ones.

Torchvision's Lanczos (torchvision >= 0.27, on the CPU) is what HF's torchvision backend uses; the
PIL backend uses Pillow's.

Prompt (vLLM's ``get_image_repl``, encoded with the tokenizer as vLLM encodes it): each
``<image>`` becomes, for a split image, per row ``<fake_token_around_image><row_r_col_c>`` +
169 ``<image>`` per sub-image then ``"\\n"``, then ``"\\n<fake_token_around_image><global-img>"``
+ 169 ``<image>`` + ``<fake_token_around_image>``; for an unsplit one only the global part
without the newline. Only ``<image>`` takes embeddings (``is_embed``).

Items as vLLM sends them: ``pixel_values`` ``[n, 3, 364, 364]`` and ``pixel_attention_mask``
``[n, 364, 364]``, both ``flat`` fields split by ``num_patches`` (the image's sub-images and its
global image, ``batched``, kept on the CPU). The mask is held as bool (an eighth of HF's int64
bytes in items and caches) and sent as int64, as vLLM sends it. vLLM's Idefics3 takes normalised
pixels, so ``mm_device_do_normalize`` is off by default; turned on, the sub-images stay uint8 and
``FusedMMInputNorm`` normalises them in fp32 as HF does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import FieldConfig, MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import (
    Backend,
    Resample,
    as_tensor_view,
    resize_chw,
    to_rgb_array,
)
from aiomm.processing.processor import (
    BaseMultiModalProcessor,
    check_uint8_exact,
    image_size,
    planned_item,
)
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = ("Idefics3MultiModalProcessor", "grid", "resized_size")

IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN = "<image>", "<fake_token_around_image>", "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
#: Idefics3's chat tokens (Llama 3's) and its image tokens
IDEFICS3_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|reserved_special_token_0|>",
    FAKE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_TOKEN, *ROW_COL_TOKENS,
)  # fmt: skip
#: HF's absolute cap on an image's longest edge after the first resize
MAX_IMAGE_SIZE = 4096

# Kwargs of Idefics3ImageProcessor that the transform reads. ``do_pad`` is left out: every
# sub-image is square, so padding adds nothing either way; ``do_resize`` too: vLLM counts the
# sub-images as if the first resize always ran, so without it the counts would not fit the pixels.
_KWARGS = frozenset({
    "size", "resample", "do_convert_rgb", "rescale_factor", "image_mean",
    "image_std", "do_image_splitting", "max_image_size",
})  # fmt: skip


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' ``_resize_output_size_rescale_to_max_len`` (``min_len`` 1)."""
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect_ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' ``_resize_output_size_scale_below_upper_bound``."""
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def resized_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """The size HF's first resize gives a ``height x width`` image."""
    return _scale_below(*_rescale_to_max_len(height, width, longest_edge), MAX_IMAGE_SIZE)


def _vision_encoder_size(height: int, width: int, side: int) -> tuple[int, int]:
    """transformers' ``resize_for_vision_encoder``: both sides to multiples of ``side``."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect_ratio) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect_ratio) / side) * side
    return height, width


def grid(height: int, width: int, side: int) -> tuple[int, int]:
    """The ``(rows, cols)`` of sub-images of an image resized to ``height x width`` for the
    vision encoder; ``(0, 0)`` for an image of one sub-image (no split)."""
    if height > side or width > side:
        return math.ceil(height / side), math.ceil(width / side)
    return 0, 0


def _longest_edge(size: Any, what: str) -> int:
    """``size["longest_edge"]`` of a dict or HF ``SizeDict``.

    :raises ProcessorKwargsError: no positive longest edge.
    """
    get = size.get if isinstance(size, Mapping) else lambda k: getattr(size, k, None)
    value = get("longest_edge")
    if not value or int(value) < 1:
        raise ProcessorKwargsError(f"Idefics3's {what} must be {{'longest_edge': n}}, got {size}")
    return int(value)


# -------------------------------------------------------------------------- offline builder

# HuggingFaceM4/Idefics3-8B-Llama3's preprocessor_config.json and processor_config.json
IDEFICS3_IMAGE_PARAMS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_pad": True,
    "do_resize": True,
    "size": {"longest_edge": 1456},
    "max_image_size": {"longest_edge": 364},
    "resample": 1,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
IDEFICS3_PROCESSOR_PARAMS: dict[str, Any] = {"image_seq_len": 169}


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``Idefics3Processor`` of Idefics3-8B-Llama3, with a tokenizer built in code.

    :raises ValueError: an unknown backend.
    """
    import transformers

    classes = {
        "torchvision": transformers.Idefics3ImageProcessor,
        "pil": transformers.Idefics3ImageProcessorPil,
    }
    if backend not in classes:
        raise ValueError(f"unknown backend {backend!r}")
    tokenizer = build_tokenizer(IDEFICS3_SPECIAL_TOKENS, eos_token=END_OF_UTTERANCE)
    tokenizer.bos_token = "<|begin_of_text|>"
    return transformers.Idefics3Processor(
        image_processor=classes[backend](**{**IDEFICS3_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        **IDEFICS3_PROCESSOR_PARAMS,
    )


@dataclass(frozen=True)
class _TransformParams:
    longest_edge: int
    side: int
    do_image_splitting: bool
    resample: Resample
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


@register(
    Architecture(
        "idefics3", "Idefics3ForConditionalGeneration", build_hf_processor,
        "HuggingFaceM4/Idefics3-8B-Llama3",
    )
)  # fmt: skip
class Idefics3MultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of Idefics3 (``Idefics3Processor``), images split into sub-images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder({"image": IMAGE_TOKEN})
    # vLLM's Idefics3 takes normalised pixels (its model does not normalise on the device)
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True
    #: the HF processor's attribute holding the global image's tag
    global_token_attribute: ClassVar[str] = "global_image_tag"

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        self.image_token_id = int(hf_processor.image_token_id)
        self.image_token: str = hf_processor.image_token
        self.fake_token: str = hf_processor.fake_image_token
        self.global_token: str = getattr(hf_processor, self.global_token_attribute)
        self.image_seq_len = int(hf_processor.image_seq_len)
        #: by (rows, cols) (a handful per processor)
        self._image_tokens: dict[tuple[int, int], PromptUpdateDetails] = {}

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads; others would be ignored."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        ip = self.image_processor
        longest = _longest_edge(hf_kwargs.get("size", ip.size), "size")
        side = _longest_edge(hf_kwargs.get("max_image_size", ip.max_image_size), "max_image_size")
        if longest % side or longest > MAX_IMAGE_SIZE:
            # the transform's grid would differ from the one vLLM counts (HF's
            # get_number_of_image_patches sizes the short side otherwise)
            raise ProcessorKwargsError(
                f"Idefics3's size longest_edge ({longest}) must be a multiple of its "
                f"max_image_size longest_edge ({side}), at most {MAX_IMAGE_SIZE}"
            )
        return resolve_params(_TransformParams, ip, hf_kwargs, longest_edge=longest, side=side)

    # the layout -----------------------------------------------------------------------------

    def encoder_size(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        """The size an image is split at (after the first resize and the multiple-of-side one)."""
        height, width = resized_size(height, width, params.longest_edge)
        if params.do_image_splitting:
            return _vision_encoder_size(height, width, params.side)
        return params.side, params.side

    def image_grid(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        """``(rows, cols)`` as vLLM counts them (HF's ``get_number_of_image_patches``, which
        sizes the short side from its own length, not from the aspect ratio; equal to the
        transform's whenever the long side is a multiple of ``max_image_size``, as with the
        checkpoint's parameters)."""
        if not params.do_image_splitting:
            return 0, 0
        height, width = resized_size(height, width, params.longest_edge)
        side = params.side
        rows_h = math.ceil(height / side) * side
        cols_w = math.ceil(width / side) * side
        return grid(rows_h, cols_w, side)

    def num_patches(self, height: int, width: int, params: _TransformParams) -> int:
        """Sub-images vLLM counts for an image: the grid and the global image, or one."""
        rows, cols = self.image_grid(height, width, params)
        return rows * cols + 1 if rows else 1

    # the transform --------------------------------------------------------------------------

    def _resize(self, image: Any, height: int, width: int, resample: Resample) -> Any:
        """One resize as the backend does it: a uint8 CHW tensor (torchvision, whose Lanczos
        HF calls through ``tvF.resize``) or an HWC uint8 array (PIL)."""
        if self.backend is Backend.PIL:
            if image.shape[:2] == (height, width):
                return image
            pil = PIL.Image.fromarray(image).resize((width, height), resample=int(resample))
            return np.array(pil)
        if tuple(image.shape[-2:]) == (height, width):
            return image
        if resample is Resample.LANCZOS:
            from torchvision.transforms.v2 import InterpolationMode  # type: ignore[import-untyped]
            from torchvision.transforms.v2 import functional as tvF

            return tvF.resize(
                image, [height, width], interpolation=InterpolationMode.LANCZOS, antialias=True
            )
        return resize_chw(image, height, width, resample)

    def _chw(self, image: Any) -> torch.Tensor:
        if self.backend is Backend.PIL:
            return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
        return image

    def split_image(self, image: Any, params: _TransformParams) -> torch.Tensor:
        """One image -> its uint8 sub-images ``[n, 3, side, side]`` (the global image last)."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        pixels: Any = rgb
        if self.backend is not Backend.PIL:
            pixels = as_tensor_view(rgb).permute(2, 0, 1)
        height, width = rgb.shape[:2]
        height, width = resized_size(height, width, params.longest_edge)
        pixels = self._resize(pixels, height, width, params.resample)
        side = params.side
        if not params.do_image_splitting:
            whole = self._resize(pixels, side, side, params.resample)
            return self._chw(whole).unsqueeze(0)
        height, width = _vision_encoder_size(height, width, side)
        pixels = self._resize(pixels, height, width, params.resample)
        chw = self._chw(pixels)
        rows, cols = grid(height, width, side)
        if not rows:
            return chw.unsqueeze(0)
        tiles = chw.reshape(3, rows, side, cols, side).permute(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, side, side)
        whole = self._chw(self._resize(pixels, side, side, params.resample))
        return torch.cat([tiles, whole.unsqueeze(0)])

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        images = hf_data.get("images") or []
        if images:
            # vLLM counts each image's sub-images from its size
            params = self._resolve_params(hf_kwargs)
            counts = [self.num_patches(*image_size(image), params) for image in images]
            passthrough["num_patches"] = torch.tensor(counts, dtype=torch.long)
        return hf_data, kwargs, passthrough

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        per_image = [self.split_image(image, params) for image in hf_data.get("images", [])]
        if not per_image:
            return {}
        tiles = torch.cat(per_image) if len(per_image) > 1 else per_image[0]
        if not self.device_normalize:
            tiles = self._cpu_normalize_tiles(tiles, params)
        # every sub-image is square: nothing is padded
        mask = torch.ones((len(tiles), params.side, params.side), dtype=torch.bool)
        return {"pixel_values": tiles, "pixel_attention_mask": mask}

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        # HF's batch of one prompt: [1, n, ...] -> [n, ...], as vLLM squeezes it
        for key, dims in (("pixel_values", 5), ("pixel_attention_mask", 4)):
            value = data.get(key)
            if isinstance(value, torch.Tensor) and value.dim() == dims:
                data[key] = value[0]
        data.pop("rows", None)
        data.pop("cols", None)
        mask = data.get("pixel_attention_mask")
        if isinstance(mask, torch.Tensor):
            # all ones (every sub-image is square); held as bool, sent as HF's int64
            data["pixel_attention_mask"] = mask.bool()
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
        """The base class's items, each image's sub-image grid in its ``prompt_data`` (its
        tokens need the grid, which ``num_patches`` alone does not give)."""
        items = super().process_items(mm_items, hf_kwargs, validated=validated)
        if items.get("image"):
            params = self._resolve_params(hf_kwargs)
            for image, item in zip(mm_items["image"], items["image"], strict=True):
                item.prompt_data["grid"] = list(self.image_grid(*image_size(image), params))
        return items

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        params = self._resolve_params(hf_kwargs)
        rows, cols = self.image_grid(height, width, params)
        patches = rows * cols + 1 if rows else 1
        return planned_item(
            "image", {"grid": [rows, cols]}, num_patches=torch.tensor(patches, dtype=torch.long)
        )

    # fields, updates ------------------------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        counts = outputs.get("num_patches")
        sizes = counts if counts is not None else []
        # in the order vLLM's render server writes an item's keys (PYTHONHASHSEED=0)
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes),
            "num_patches": MultiModalFieldConfig.batched("image"),
            "pixel_attention_mask": MultiModalFieldConfig.flat_from_sizes("image", sizes),
        }

    def image_text(self, rows: int, cols: int) -> str:
        """vLLM's ``get_image_repl`` text of an image of ``rows x cols`` sub-images."""
        p_img = self.image_token * self.image_seq_len
        global_part = self.fake_token + self.global_token + p_img
        if rows == 0 and cols == 0:
            return global_part + self.fake_token
        parts = []
        for r in range(rows):
            for c in range(cols):
                parts.append(f"{self.fake_token}<row_{r + 1}_col_{c + 1}>{p_img}")
            parts.append("\n")
        return "".join([*parts, "\n", global_part, self.fake_token])

    def image_tokens(self, rows: int, cols: int) -> PromptUpdateDetails:
        """The tokens of an image of ``rows x cols`` sub-images, as vLLM encodes its text."""
        cached = self._image_tokens.get((rows, cols))
        if cached is not None:
            return cached
        ids = self.hf_processor.tokenizer.encode(
            self.image_text(rows, cols), add_special_tokens=False
        )
        details = PromptUpdateDetails.select_token_id(ids, self.image_token_id)
        self._image_tokens[(rows, cols)] = details
        return details

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])

        def replacement(i: int) -> PromptUpdateDetails:
            rows, cols = items[i].prompt_data["grid"]
            return self.image_tokens(int(rows), int(cols))

        return [PromptReplacement("image", [self.image_token_id], replacement)]
