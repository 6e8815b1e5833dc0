"""InternVL 3 / 3.5 in transformers' format (``InternVLForConditionalGeneration``), images.

Reference: transformers' ``InternVLProcessor`` with ``GotOcr2ImageProcessor`` (torchvision
backend) or ``GotOcr2ImageProcessorPil`` (PIL backend), as the ``-hf`` checkpoints configure them
(``OpenGVLab/InternVL3-1B-hf``, ``OpenGVLab/InternVL3_5-1B-HF``): 448 px tiles, ImageNet mean/std,
bicubic resampling, 1..12 tiles, 256 tokens per tile. vLLM 0.33 serves the architecture with
``InternS1ForConditionalGeneration`` (``vllm/model_executor/models/interns1.py``), which calls that
HF processor one image at a time.

The transform (``crop_to_patches``, which ``InternVLProcessor`` turns on by default), per image:

1. candidate grids ``(cols, rows)`` with ``min_patches <= cols * rows <= max_patches``, ordered
   by tile count (stable, cols-major within a count); the grid whose ``cols / rows`` is closest
   to the image's ``width / height`` wins; on an exact tie a later grid (as many tiles or more)
   replaces it while the image's area exceeds half the grid's canvas (:func:`select_tile_grid`);
2. bicubic resize to ``(cols * 448, rows * 448)``, cut into tiles row-major;
3. with more than one tile, the whole image resized to one tile (bicubic) is appended;
4. rescale/normalise, on the CPU by default as vLLM's render server sends the tiles normalised
   (with ``mm_device_do_normalize`` on the device: the tiles stay uint8, NCHW).

Without ``crop_to_patches`` (or with ``max_patches`` below 2) the image is one resized tile.

Each ``<IMG_CONTEXT>`` in the prompt becomes ``<img>`` + ``<IMG_CONTEXT>`` x (256 x tiles) +
``</img>``; only the ``<IMG_CONTEXT>`` tokens take embeddings. Items are laid out as vLLM's
``InternS1MultiModalProcessor`` sends them: ``pixel_values`` (flat over the image's tiles),
``image_num_patches`` (batched, kept on the CPU) and, written by the server, ``image_token_id``
(shared, kept on the CPU).

Videos: vLLM's class takes them through the HF processor (``InternVLVideoProcessor``), but its
render server samples them with its generic OpenCV loader (32 frames spread evenly), which aiomm
does not reproduce, and writes ``<video>`` tokens where HF's prompt has ``<IMG_CONTEXT>``; this
adapter handles images only (``aiomm serve`` refuses videos for it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.nemotron_vl import (
    IMG_CONTEXT,
    IMG_END,
    IMG_START,
    TiledImageItems,
    split_tiles,
)
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalKwargsItem
from aiomm.processing.image_ops import Resample, resize, to_rgb_array
from aiomm.processing.processor import BaseMultiModalProcessor, image_size, planned_item

__all__ = (
    "INTERNVL_IMAGE_PARAMS",
    "InternVLMultiModalProcessor",
    "build_hf_processor",
    "select_tile_grid",
    "supported_grids",
)

IMAGE_PLACEHOLDER = IMG_CONTEXT
VIDEO_TOKEN = "<video>"
#: Qwen2.5's chat tokens and the checkpoints' added tokens (the ``-hf`` conversion's)
INTERNVL_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", IMG_START, IMG_END, IMG_CONTEXT, "<quad>",
    "</quad>", "<ref>", "</ref>", "<box>", "</box>", VIDEO_TOKEN,
)  # fmt: skip
#: the tokenizer attributes ``InternVLProcessor`` reads (``extra_special_tokens``)
_NAMED_TOKENS = {
    "start_image_token": IMG_START,
    "end_image_token": IMG_END,
    "context_image_token": IMG_CONTEXT,
    "video_token": VIDEO_TOKEN,
}

#: ``InternVLProcessor`` passes ``crop_to_patches=True`` unless a call says otherwise (its
#: ``images_kwargs`` default wins over the image processor's own ``False``)
_CROP_TO_PATCHES_DEFAULT = True
# The image processor's kwargs the transform reads. ``do_resize`` is left out (unresized
# images of different sizes cannot share vLLM's flat field), and so is ``do_convert_rgb``.
_KWARGS = frozenset({
    "crop_to_patches", "min_patches", "max_patches", "size", "resample", "rescale_factor",
    "image_mean", "image_std",
})  # fmt: skip
_INT_KWARGS = ("min_patches", "max_patches")

# ------------------------------------------------------------------------------ the tile grid


@functools.lru_cache(maxsize=16)
def supported_grids(min_patches: int, max_patches: int) -> tuple[tuple[int, int], ...]:
    """Every ``(cols, rows)`` with ``min_patches <= cols * rows <= max_patches``, ordered as
    transformers' ``get_all_supported_aspect_ratios`` orders them (by tile count, stable)."""
    grids = [
        (cols, rows)
        for cols in range(1, max_patches + 1)
        for rows in range(1, max_patches + 1)
        if min_patches <= cols * rows <= max_patches
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def select_tile_grid(
    height: int,
    width: int,
    *,
    tile_height: int,
    tile_width: int,
    min_patches: int,
    max_patches: int,
) -> tuple[int, int]:
    """The ``(cols, rows)`` grid transformers' ``get_optimal_tiled_canvas`` picks for a
    ``height x width`` image, with the same float operations (exact ties decide grids)."""
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for cols, rows in supported_grids(min_patches, max_patches):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile_height * tile_width * cols * rows:
            # more tiles for an equally close ratio, while the image fills half the canvas
            best = (cols, rows)
    return best


# -------------------------------------------------------------------------- offline builder

#: OpenGVLab/InternVL3-1B-hf's (and InternVL3_5-1B-HF's) preprocessor_config.json
INTERNVL_IMAGE_PARAMS: dict[str, Any] = {
    "size": {"height": 448, "width": 448},
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "min_patches": 1,
    "max_patches": 12,
}
#: the processor's own parameter: (448 / 14)^2 patches x 0.5^2 pixel-shuffle per tile
INTERNVL_IMAGE_SEQ_LENGTH = 256


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``InternVLProcessor`` of InternVL3-1B-hf, with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.GotOcr2ImageProcessor,
        "pil": transformers.GotOcr2ImageProcessorPil,
    }[backend]
    words = build_tokenizer(INTERNVL_SPECIAL_TOKENS, eos_token="<|im_end|>")
    # the same tokens, named as the processor reads them
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words.backend_tokenizer,
        unk_token=words.unk_token,
        eos_token=words.eos_token,
        pad_token="<|endoftext|>",
        extra_special_tokens=_NAMED_TOKENS,
    )
    # the checkpoint's video processor: the image processor's tiles and normalisation
    video = {k: INTERNVL_IMAGE_PARAMS[k] for k in ("size", "image_mean", "image_std")}
    return transformers.InternVLProcessor(
        image_processor=image_cls(**{**INTERNVL_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        video_processor=transformers.InternVLVideoProcessor(**video),
        image_seq_length=INTERNVL_IMAGE_SEQ_LENGTH,
    )


# ---------------------------------------------------------------------------- the processor


@dataclass(frozen=True)
class _TransformParams:
    crop_to_patches: bool
    min_patches: int
    max_patches: int
    tile_height: int
    tile_width: int
    resample: Resample
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @property
    def tiles(self) -> bool:
        """Whether images are cut into tiles (both backends skip it below two tiles)."""
        return self.crop_to_patches and self.max_patches > 1


def _tile_size(size: Any) -> tuple[int, int]:
    """``(height, width)`` of a tile from the ``size`` kwarg or attribute.

    :raises ProcessorKwargsError: a size without positive ``height`` and ``width``.
    """
    get = size.get if isinstance(size, Mapping) else lambda k: getattr(size, k, None)
    height, width = get("height"), get("width")
    if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
        raise ProcessorKwargsError(
            "InternVL needs size={'height': h, 'width': w} with positive integers"
        )
    return height, width


@register(
    Architecture(
        "internvl", "InternVLForConditionalGeneration", build_hf_processor,
        "OpenGVLab/InternVL3-1B-hf, OpenGVLab/InternVL3_5-1B-HF",
    )
)  # fmt: skip
class InternVLMultiModalProcessor(TiledImageItems, BackendNormalization, BaseMultiModalProcessor):
    """Processor of InternVL 3 / 3.5 (``InternVLProcessor``), images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW
    # vLLM's InternS1ForConditionalGeneration takes normalised pixels (it does not support
    # mm_device_do_normalize), so its render server sends them normalised
    default_device_normalize: ClassVar[bool] = False

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        #: the context token's id, as vLLM's items carry it (``WireForm.image_token_id``)
        self.image_token_id = int(hf_processor.image_token_id)
        self.placeholder_ids = [self.image_token_id]
        self.tile_tokens = (
            int(hf_processor.start_image_token_id),
            self.image_token_id,
            int(hf_processor.end_image_token_id),
        )
        self.image_seq_length = int(hf_processor.image_seq_length)

    @property
    def tokens_per_tile(self) -> int:
        return self.image_seq_length

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads; others would be ignored."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        ip = self.image_processor
        for key in _INT_KWARGS:
            value = hf_kwargs.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ProcessorKwargsError(f"{key} must be an integer, got {value!r}")
        tile_height, tile_width = _tile_size(hf_kwargs.get("size", ip.size))
        return resolve_params(
            _TransformParams, ip, hf_kwargs,
            crop_to_patches=bool(hf_kwargs.get("crop_to_patches", _CROP_TO_PATCHES_DEFAULT)),
            tile_height=tile_height, tile_width=tile_width,
        )  # fmt: skip

    # the transform --------------------------------------------------------------------------

    def grid(self, height: int, width: int, params: _TransformParams) -> tuple[int, int]:
        """The ``(cols, rows)`` tile grid of a ``height x width`` image ((1, 1): one tile)."""
        if not params.tiles:
            return 1, 1
        return select_tile_grid(
            height, width,
            tile_height=params.tile_height, tile_width=params.tile_width,
            min_patches=params.min_patches, max_patches=params.max_patches,
        )  # fmt: skip

    def num_tiles(self, height: int, width: int, params: _TransformParams) -> int:
        """Tiles of a ``height x width`` image, the thumbnail included."""
        cols, rows = self.grid(height, width, params)
        return cols * rows + (1 if cols * rows > 1 else 0)

    def tile_image(self, image: Any, params: _TransformParams) -> torch.Tensor:
        """One image -> uint8 tiles ``[n, 3, h, w]`` (the thumbnail last)."""
        rgb = to_rgb_array(image)
        cols, rows = self.grid(rgb.shape[0], rgb.shape[1], params)
        th, tw = params.tile_height, params.tile_width
        chw = resize(rgb, rows * th, cols * tw, params.resample, self.backend)
        tiles = split_tiles(chw, rows, cols)
        if rows * cols > 1:
            thumbnail = resize(rgb, th, tw, params.resample, self.backend)
            tiles = torch.cat([tiles, thumbnail.unsqueeze(0)])
        return tiles.contiguous()

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        per_image = [self.tile_image(image, params) for image in hf_data.get("images", [])]
        if not per_image:
            return {}
        pixel_values = torch.cat(per_image) if len(per_image) > 1 else per_image[0]
        if not self.device_normalize:
            pixel_values = self._cpu_normalize_tiles(pixel_values, params)
        counts = np.array([len(t) for t in per_image], dtype=np.int64)
        return {"pixel_values": pixel_values, "image_num_patches": torch.from_numpy(counts)}

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        images = hf_data.get("images")
        if self.transform == "hf" and images:
            # HF's processor keeps the tile counts to itself; they follow from the image sizes
            params = self._resolve_params(kwargs)
            counts = [self.num_tiles(*image_size(image), params) for image in images]
            passthrough["image_num_patches"] = torch.tensor(counts, dtype=torch.long)
        return hf_data, kwargs, passthrough

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        tiles = self.num_tiles(height, width, self._resolve_params(hf_kwargs))
        return planned_item("image", image_num_patches=torch.tensor(tiles, dtype=torch.long))
