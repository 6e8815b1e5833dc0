"""Llama 4 (``Llama4ForConditionalGeneration``: Llama 4 Scout and Maverick), images.

Reference: transformers' ``Llama4Processor`` with ``Llama4ImageProcessor`` (torchvision backend;
transformers has no PIL Llama 4 image processor, and ``AutoImageProcessor`` asked for the PIL
backend falls back to it, as :func:`build_hf_processor` does), as
``meta-llama/Llama-4-Scout-17B-16E-Instruct`` configures them: tiles of 336 px, ``max_patches``
16, ``resize_to_max_canvas`` off, bilinear, mean/std 0.5; vision patch 14 with a 0.5 pixel
shuffle, so 144 tokens per tile. vLLM 0.33's ``Mllama4MultiModalProcessor`` (``mllama4.py``)
runs that processor and adds the per-image fields.

The transform, per image:

1. the canvas: among the ``rows x cols`` grids of at most ``max_patches`` tiles (HF's
   ``find_supported_resolutions`` order), the one needing the smallest upscale, else the
   smallest downscale, the smallest area among equals (``get_best_fit``, in float32 as HF
   computes it);
2. the image resized without distortion to fit the canvas, never up beyond one tile's side
   (``get_max_res_without_distortion``, in HF's mix of float32 and float64), bilinear;
3. padded with zeros at the bottom and right to the canvas and cut into tiles, row by row;
4. with more than one tile, the whole image resized to one tile (distorted) is appended.

Each ``<|image|>`` becomes ``<|image_start|>``, then with more than one tile ``rows`` runs of the
row's tiles (144 ``<|patch|>`` each, ``<|tile_x_separator|>`` between them) each ended by
``<|tile_y_separator|>``, then ``<|image|>``, 144 ``<|patch|>`` for the global (or only) tile
and ``<|image_end|>``; only the ``<|patch|>`` tokens take embeddings (``is_embed``), as vLLM
selects them.

Items as vLLM sends them: ``pixel_values`` (every tile of every image, ``[tiles, 3, 336, 336]``, a
``flat`` field split by ``patches_per_image``), ``patches_per_image`` (the image's tile count,
``batched``) and ``aspect_ratios`` (``[rows, cols]``, ``batched``), both kept on the CPU.

Normalisation. ``Llama4ImageProcessor`` rescales and normalises in bfloat16 (two roundings), so
its output cannot be reproduced by one fp32 expression: vLLM 0.33 does not defer it to the
device for Llama 4, and ``mm_device_do_normalize`` is off by default here too (the classic path
runs the image processor's own ``rescale_and_normalize`` on the uint8 tiles, equal to HF's bit
for bit). Turned on, the tiles stay uint8 and ``FusedMMInputNorm`` normalises them in fp32, within
one bfloat16 rounding of HF's values. The ``native`` transform is proven equal to ``hf`` bit for
bit by tests/adapters/test_parity.py.
"""

from __future__ import annotations

import functools
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
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import Resample, resize, to_rgb_array
from aiomm.processing.processor import BaseMultiModalProcessor, image_size, planned_item
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "Llama4MultiModalProcessor",
    "best_fit_grid",
    "fit_without_distortion",
    "supported_grids",
)

IMAGE_PLACEHOLDER = "<|image|>"
IMAGE_START, IMAGE_END, PATCH = "<|image_start|>", "<|image_end|>", "<|patch|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
#: Llama 4's chat tokens and its image tokens
LLAMA4_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eom|>",
    "<|eot|>", "<|finetune_right_pad|>", IMAGE_START, IMAGE_END, IMAGE_PLACEHOLDER, PATCH,
    TILE_X, TILE_Y,
)  # fmt: skip

# Kwargs of Llama4ImageProcessor that the transform reads. ``do_resize`` is left out: HF refuses
# do_resize=False (the tiles would differ in shape).
_KWARGS = frozenset({
    "size", "resample", "do_convert_rgb", "rescale_factor", "image_mean", "image_std",
    "max_patches", "resize_to_max_canvas",
})  # fmt: skip

_F32 = np.float32


@functools.cache
def supported_grids(max_patches: int) -> tuple[tuple[int, int], ...]:
    """Every ``(rows, cols)`` grid of at most ``max_patches`` tiles, in the order of
    transformers' ``find_supported_resolutions`` (grouped by aspect ratio in order of first
    appearance, counts from ``max_patches`` down)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_patches, 0, -1):
        factors = sorted({f for i in range(1, math.isqrt(count) + 1) if count % i == 0
                          for f in (i, count // i)})  # fmt: skip
        for rows in factors:
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return tuple(grid for grids in by_ratio.values() for grid in grids)


@functools.lru_cache(maxsize=4096)
def best_fit_grid(
    height: int, width: int, *, tile: int, max_patches: int, resize_to_max_canvas: bool
) -> tuple[int, int]:
    """The ``(rows, cols)`` tile grid of an image, as transformers' ``get_best_fit`` picks its
    canvas (float32 scales, as HF's tensors hold them)."""
    grids = supported_grids(max_patches)
    scales = [
        min(_F32(rows * tile) / _F32(height), _F32(cols * tile) / _F32(width))
        for rows, cols in grids
    ]
    up = [s for s in scales if s >= 1]
    if up:
        selected = max(up) if resize_to_max_canvas else min(up)
    else:
        selected = max(s for s in scales if s < 1)
    # the smallest canvas among those of that scale; the first one on a tie (torch.argmin)
    chosen = [grid for grid, s in zip(grids, scales, strict=True) if s == selected]
    return min(chosen, key=lambda g: g[0] * g[1])


def fit_without_distortion(
    height: int, width: int, bound_h: int, bound_w: int, *, f32_h: bool, f32_w: bool
) -> tuple[int, int]:
    """transformers' ``get_max_res_without_distortion`` of ``height x width`` into
    ``bound_h x bound_w``, in HF's arithmetic: a bound HF holds as a tensor element (``f32_h``,
    ``f32_w``: it came from the canvas) makes its scale, and the products with it, float32;
    a plain int bound, float64."""
    scale_w: Any = _F32(bound_w) / _F32(width) if f32_w else bound_w / width
    scale_h: Any = _F32(bound_h) / _F32(height) if f32_h else bound_h / height
    if f32_h or f32_w:  # a tensor compared with a Python float: in float32
        narrower = _F32(scale_w) < _F32(scale_h)
    else:
        narrower = scale_w < scale_h
    if narrower:
        product = _F32(height) * scale_w if f32_w else height * scale_w
        return min(math.floor(product), bound_h), bound_w
    product = _F32(width) * scale_h if f32_h else width * scale_h
    return bound_h, min(math.floor(product), bound_w)


# -------------------------------------------------------------------------- offline builder

# meta-llama/Llama-4-Scout-17B-16E-Instruct's processor_config.json and preprocessor_config.json
LLAMA4_PROCESSOR_PARAMS: dict[str, Any] = {"patch_size": 14, "pixel_shuffle_ratio": 0.5}
LLAMA4_IMAGE_PARAMS: dict[str, Any] = {
    "size": {"height": 336, "width": 336},
    "max_patches": 16,
    "resize_to_max_canvas": False,
    "resample": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``Llama4Processor`` of Llama 4 Scout, with a tokenizer built in code. ``backend="pil"``
    gives the torchvision image processor too: transformers has no other for Llama 4 (its
    ``AutoImageProcessor`` falls back to it the same way).

    :raises ValueError: an unknown backend.
    """
    import transformers

    if backend not in ("torchvision", "pil"):
        raise ValueError(f"unknown backend {backend!r}")
    tokenizer = build_tokenizer(LLAMA4_SPECIAL_TOKENS, eos_token="<|eot|>")
    return transformers.Llama4Processor(
        image_processor=transformers.Llama4ImageProcessor(**{**LLAMA4_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        **LLAMA4_PROCESSOR_PARAMS,
    )


def _square_tile(size: Any) -> int:
    """The tile side of a ``size`` dict or HF ``SizeDict`` (``{"height": n, "width": n}``).

    :raises ProcessorKwargsError: a size that is not a square of positive sides.
    """
    get = size.get if isinstance(size, Mapping) else lambda k, d=None: getattr(size, k, d)
    height, width = get("height", None), get("width", None)
    if not height or not width or int(height) != int(width):
        raise ProcessorKwargsError(
            f"Llama 4's tiles are square: size must be {{'height': n, 'width': n}}, got {size}"
        )
    return int(height)


@dataclass(frozen=True)
class _TransformParams:
    tile: int
    max_patches: int
    resize_to_max_canvas: bool
    resample: Resample
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


@dataclass(frozen=True)
class _Layout:
    """Where one image goes: its tile grid and the size its content is resized to."""

    rows: int
    cols: int
    height: int
    width: int

    @property
    def tiles(self) -> int:
        """Tiles sent: the grid's, plus the global tile when there are several."""
        return 1 if self.rows * self.cols == 1 else 1 + self.rows * self.cols


@register(
    Architecture(
        "llama4", "Llama4ForConditionalGeneration", build_hf_processor,
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    )
)  # fmt: skip
class Llama4MultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of Llama 4 (``Llama4Processor``), images."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    # HF normalises in bfloat16: only its own operations reproduce it (module docstring)
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        tokenizer = hf_processor.tokenizer
        self.image_token_id = int(hf_processor.image_token_id)
        ids = tokenizer.convert_tokens_to_ids(
            [
                hf_processor.start_of_img_token,
                hf_processor.end_of_img_token,
                hf_processor.img_patch_token,
                hf_processor.tile_token,
                hf_processor.tile_global_token,
            ]
        )
        self.start_id, self.end_id, self.patch_id, self.tile_x_id, self.tile_y_id = map(int, ids)
        self.patch_size = int(hf_processor.patch_size)
        self.downsample_ratio = int(hf_processor.downsample_ratio)

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image processor's kwargs that the transform reads; others would be ignored."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        tile = _square_tile(hf_kwargs.get("size", self.image_processor.size))
        params = resolve_params(_TransformParams, self.image_processor, hf_kwargs, tile=tile)
        if params.max_patches < 1:
            raise ProcessorKwargsError(f"max_patches must be at least 1, got {params.max_patches}")
        return params

    # the transform --------------------------------------------------------------------------

    def layout(self, height: int, width: int, params: _TransformParams) -> _Layout:
        """The tile grid of a ``height x width`` image and the size it is resized to."""
        tile = params.tile
        rows, cols = best_fit_grid(
            height, width, tile=tile, max_patches=params.max_patches,
            resize_to_max_canvas=params.resize_to_max_canvas,
        )  # fmt: skip
        canvas_h, canvas_w = rows * tile, cols * tile
        if params.resize_to_max_canvas:
            bound_h, bound_w, f32_h, f32_w = canvas_h, canvas_w, True, True
        else:
            # HF's min(max(side, tile), canvas side) keeps the canvas side (a tensor element)
            # only where it is the smaller
            floor_h, floor_w = max(height, tile), max(width, tile)
            f32_h, f32_w = canvas_h < floor_h, canvas_w < floor_w
            bound_h, bound_w = min(floor_h, canvas_h), min(floor_w, canvas_w)
        new_h, new_w = fit_without_distortion(
            height, width, bound_h, bound_w, f32_h=f32_h, f32_w=f32_w
        )
        return _Layout(rows, cols, max(new_h, 1), max(new_w, 1))

    def tile_image(self, image: Any, params: _TransformParams) -> tuple[torch.Tensor, _Layout]:
        """One image -> its uint8 tiles ``[n, 3, tile, tile]`` (the global tile last) and its
        layout."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        height, width = rgb.shape[:2]
        where = self.layout(height, width, params)
        tile, rows, cols = params.tile, where.rows, where.cols
        content = resize(rgb, where.height, where.width, params.resample, self.backend)
        canvas = torch.zeros((3, rows * tile, cols * tile), dtype=torch.uint8)
        canvas[:, : where.height, : where.width] = content
        tiles = canvas.view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, tile, tile)
        if rows * cols > 1:
            whole = resize(rgb, tile, tile, params.resample, self.backend)
            tiles = torch.cat([tiles, whole.unsqueeze(0)])
        return tiles, where

    def _fields_of(self, layouts: list[_Layout]) -> dict[str, torch.Tensor]:
        return {
            "patches_per_image": torch.tensor([w.tiles for w in layouts], dtype=torch.long),
            "aspect_ratios": torch.tensor([[w.rows, w.cols] for w in layouts], dtype=torch.long),
        }

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        if self.transform == "hf" and hf_data.get("images"):
            # vLLM's fields, from the images' sizes (HF returns no per-image field)
            params = self._resolve_params(kwargs)
            layouts = [self.layout(*image_size(image), params) for image in hf_data["images"]]
            passthrough.update(self._fields_of(layouts))
        return hf_data, kwargs, passthrough

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        done = [self.tile_image(image, params) for image in hf_data.get("images", [])]
        if not done:
            return {}
        tiles = torch.cat([t for t, _ in done]) if len(done) > 1 else done[0][0]
        if not self.device_normalize:
            tiles = self.image_processor.rescale_and_normalize(
                tiles, True, params.rescale_factor, True,
                tuple(params.image_mean), tuple(params.image_std),
            )  # fmt: skip
        return {"pixel_values": tiles, **self._fields_of([w for _, w in done])}

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        where = self.layout(height, width, self._resolve_params(hf_kwargs))
        return planned_item(
            "image",
            patches_per_image=torch.tensor(where.tiles, dtype=torch.long),
            aspect_ratios=[where.rows, where.cols],
        )

    # fields, updates ------------------------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        counts = outputs.get("patches_per_image")
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes(
                "image", counts if counts is not None else []
            ),
            "patches_per_image": MultiModalFieldConfig.batched("image"),
            "aspect_ratios": MultiModalFieldConfig.batched("image"),
        }

    def patches_per_tile(self, hf_kwargs: Mapping[str, Any]) -> int:
        """``<|patch|>`` tokens per tile: the tile's vision patches after the pixel shuffle."""
        tile = _square_tile(hf_kwargs.get("size", self.image_processor.size))
        return (tile // self.patch_size) ** 2 // self.downsample_ratio

    def image_tokens(self, rows: int, cols: int, per_tile: int) -> list[int]:
        """The tokens of one image of ``rows x cols`` tiles (HF's ``_prompt_split_image``)."""
        patches = [self.patch_id] * per_tile
        tokens = [self.start_id]
        if rows * cols > 1:
            row = [*patches]
            for _ in range(cols - 1):
                row += [self.tile_x_id, *patches]
            tokens += [*row, self.tile_y_id] * rows
        tokens += [self.image_token_id, *patches, self.end_id]
        return tokens

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        per_tile = self.patches_per_tile(hf_kwargs)

        def replacement(i: int) -> PromptUpdateDetails:
            rows, cols = (int(v) for v in items[i].data["aspect_ratios"])
            return PromptUpdateDetails.select_token_id(
                self.image_tokens(rows, cols, per_tile), self.patch_id
            )

        return [PromptReplacement("image", [self.image_token_id], replacement)]
