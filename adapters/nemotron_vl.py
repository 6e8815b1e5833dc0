"""Llama Nemotron VL retrieval models: the embedder and the reranker (images).

Reference: vLLM's ``LlamaNemotronVLEmbedProcessor`` in ``vllm/model_executor/models/nemotron_vl.py``
(vllm-project/vllm), registered for ``LlamaNemotronVLForEmbedding`` and inherited by
``LlamaNemotronVLForSequenceClassification``. It restates the model cards' published
preprocessing (``nvidia/llama-nemotron-embed-vl-1b-v2``, ``nvidia/llama-nemotron-rerank-vl-1b-v2``;
the same ``dynamic_preprocess`` ships in NVIDIA-NeMo/Automodel's
``components/models/llama_nemotron_vl/processor.py``). transformers has no processor for these
architectures, so :func:`build_reference` returns a :class:`NemotronVLReference`: the tokenizer
(built in code with the model's image tokens) and the published parameters, not an HF processor.
Only the ``native`` transform exists.

The transform, per image (InternVL's dynamic tiling with Nemotron's tile choice):

1. candidate grids ``(cols, rows)`` with ``min_num <= cols * rows <= max_num``, ordered by tile
   count; the grid maximising ``min(cols * rows * size**2 / area, 0.6) * closeness`` wins, where
   ``closeness = min(r / a, a / r)`` for the grid's and the image's aspect ratios (first wins ties);
2. PIL bicubic resize to ``(cols * size, rows * size)``, cut into ``size x size`` tiles row-major;
3. with ``use_thumbnail`` and more than one tile, the whole image resized to ``size x size``
   (PIL bicubic) is appended;
4. ``/ 255`` then SigLIP's mean/std 0.5 (here on the device: tiles stay uint8, NCHW).

Each ``<image>`` becomes ``<img>`` + ``<IMG_CONTEXT>`` x (256 x tiles) + ``</img>``; only the
``<IMG_CONTEXT>`` tokens take embeddings. Parameters: tiles of 512 px, SigLIP 2 patch 16 and a
0.5 pixel-shuffle (256 tokens per tile), 1..6 tiles plus a thumbnail, as the model cards run them.
Images are converted to RGB before tiling (the model cards' order; vLLM converts each tile, which
differs only for non-RGB inputs such as palette or RGBA images).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ProcessorKwargsError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import Backend, Resample, resize, to_rgb_array
from aiomm.processing.processor import (
    BaseMultiModalProcessor,
    NormalizationParams,
    planned_item,
)
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate, PromptUpdateDetails

__all__ = (
    "LlamaNemotronVLProcessor",
    "NemotronVLReference",
    "TiledImageItems",
    "build_reference",
    "select_tile_grid",
    "split_tiles",
)

IMAGE_PLACEHOLDER = "<image>"
IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
#: Llama 3.2's chat tokens and the retrievers' image tokens.
NEMOTRON_VL_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", IMG_START, IMG_END, IMG_CONTEXT, IMAGE_PLACEHOLDER,
)  # fmt: skip

# A grid's area bonus saturates once it covers 60% of the original image (the reference's rule).
_AREA_CAP = 0.6
_TILE_KWARGS = frozenset({"min_dynamic_patch", "max_dynamic_patch", "dynamic_image_size"})


@dataclass(frozen=True)
class NemotronVLReference:
    """The published preprocessing of Llama Nemotron VL, with its tokenizer (no HF processor)."""

    tokenizer: Any
    image_size: int = 512
    patch_size: int = 16
    downsample_ratio: float = 0.5
    min_dynamic_patch: int = 1
    max_dynamic_patch: int = 6
    dynamic_image_size: bool = True
    use_thumbnail: bool = True
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @property
    def num_image_token(self) -> int:
        """Tokens per tile: the patch grid after pixel-shuffle."""
        return int((self.image_size // self.patch_size) ** 2 * self.downsample_ratio**2)

    def config_entries(self) -> dict[str, Any]:
        """The tiling parameters as the checkpoints' ``config.json`` spells them (InternVL's
        keys); :meth:`from_pretrained` reads them back."""
        return {
            "force_image_size": self.image_size,
            "downsample_ratio": self.downsample_ratio,
            "min_dynamic_patch": self.min_dynamic_patch,
            "max_dynamic_patch": self.max_dynamic_patch,
            "dynamic_image_size": self.dynamic_image_size,
            "use_thumbnail": self.use_thumbnail,
            "vision_config": {"patch_size": self.patch_size, "image_size": self.image_size},
        }

    def save_pretrained(self, path: str | Path) -> None:
        """Write the tokenizer into the folder ``path`` (the parameters belong in its
        ``config.json``: :meth:`config_entries`)."""
        self.tokenizer.save_pretrained(str(path))

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> NemotronVLReference:
        """The folder's tokenizer and the tiling parameters of its ``config.json`` (the
        published ones where it has none); ``overrides`` win.

        :raises OSError: the folder has no tokenizer.
        """
        from transformers import AutoTokenizer

        folder = Path(path)
        config: dict[str, Any] = {}
        if (folder / "config.json").is_file():
            config = json.loads((folder / "config.json").read_text())
        vision = config.get("vision_config") or {}
        params: dict[str, Any] = {
            "image_size": config.get("force_image_size") or vision.get("image_size"),
            "patch_size": vision.get("patch_size"),
            **{
                key: config.get(key)
                for key in (
                    "downsample_ratio",
                    "min_dynamic_patch",
                    "max_dynamic_patch",
                    "dynamic_image_size",
                    "use_thumbnail",
                )
            },
        }
        params = {k: v for k, v in params.items() if v is not None}
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return cls(tokenizer=tokenizer, **{**params, **overrides})


def build_reference(backend: str = "pil", **overrides: Any) -> NemotronVLReference:
    """The reference parameters with an offline tokenizer (``backend``: PIL, the only one)."""
    if backend not in ("pil", "torchvision"):
        raise ValueError(f"unknown backend {backend!r}")
    tokenizer = build_tokenizer(NEMOTRON_VL_SPECIAL_TOKENS, eos_token="<|end_of_text|>")
    return NemotronVLReference(tokenizer=tokenizer, **overrides)


@functools.lru_cache(maxsize=16)
def count_ordered_grids(min_num: int, max_num: int) -> tuple[tuple[int, int], ...]:
    """Every ``(cols, rows)`` with ``min_num <= cols * rows <= max_num`` in the order the
    InternVL-style references (Nemotron VL's, vLLM's DeepSeek-OCR) visit them: a set built over
    ``n``, ``cols``, ``rows`` and sorted by tile count only, so among equal counts the set's own
    order (which decides exact ties) is kept."""
    grids = {
        (cols, rows)
        for n in range(min_num, max_num + 1)
        for cols in range(1, n + 1)
        for rows in range(1, n + 1)
        if min_num <= cols * rows <= max_num
    }
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def select_tile_grid(
    width: int, height: int, *, image_size: int, min_num: int, max_num: int
) -> tuple[int, int]:
    """The ``(cols, rows)`` tile grid the reference picks for a ``width x height`` image."""
    aspect = width / height
    area = width * height
    best, best_score = (1, 1), float("-inf")
    for cols, rows in count_ordered_grids(min_num, max_num):
        grid_aspect = cols / rows
        score = min((cols * rows * image_size * image_size) / area, _AREA_CAP) * min(
            grid_aspect / aspect, aspect / grid_aspect
        )
        if score > best_score:
            best, best_score = (cols, rows), score
    return best


def split_tiles(chw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A ``C x (rows * h) x (cols * w)`` image cut into ``[rows * cols, C, h, w]`` tiles,
    row-major (InternVL's order)."""
    channels, height, width = chw.shape
    tile_h, tile_w = height // rows, width // cols
    tiles = chw.reshape(channels, rows, tile_h, cols, tile_w).permute(1, 3, 0, 2, 4)
    return tiles.reshape(rows * cols, channels, tile_h, tile_w)


@dataclass(frozen=True)
class _TileParams:
    """Read from the request's kwargs, else the reference's parameters (``resolve_params``)."""

    dynamic_image_size: bool
    min_dynamic_patch: int
    max_dynamic_patch: int
    use_thumbnail: bool

    @property
    def min_num(self) -> int:
        return self.min_dynamic_patch if self.dynamic_image_size else 1

    @property
    def max_num(self) -> int:
        return self.max_dynamic_patch if self.dynamic_image_size else 1


class TiledImageItems:
    """Mixin (listed before ``BaseMultiModalProcessor``) of InternVL-style tiled images: items
    with the tiles flat (``pixel_values``, split by ``image_num_patches``) and each placeholder
    replaced by ``<img>``, ``<IMG_CONTEXT>`` x (tokens per tile x tiles) and ``</img>``, the
    context tokens taking the embeddings.

    The adapter sets ``placeholder_ids`` (what the prompt holds per image), ``tile_tokens``
    (the ids of ``<img>``, ``<IMG_CONTEXT>`` and ``</img>``) and ``tokens_per_tile``.
    """

    placeholder_ids: list[int]
    tile_tokens: tuple[int, int, int]

    @property
    def tokens_per_tile(self) -> int:
        """Context tokens per tile."""
        raise NotImplementedError

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        counts = outputs.get("image_num_patches")
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes(
                "image", counts if counts is not None else []
            ),
            "image_num_patches": MultiModalFieldConfig.batched("image"),
        }

    def image_tokens(self, num_tiles: int) -> PromptUpdateDetails:
        """``<img>`` + ``<IMG_CONTEXT>`` x (tokens x tiles) + ``</img>``; embeds on the context."""
        start, context, end = self.tile_tokens
        return PromptUpdateDetails.select_token_id(
            [start, *[context] * (self.tokens_per_tile * num_tiles), end], context
        )

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])

        def replacement(i: int) -> PromptUpdateDetails:
            return self.image_tokens(int(items[i].data["image_num_patches"]))

        return [PromptReplacement("image", self.placeholder_ids, replacement)]


@register(
    Architecture(
        "llama-nemotron-vl-embed", "LlamaNemotronVLForEmbedding", build_reference,
        "nvidia/llama-nemotron-embed-vl-1b-v2",
        # the checkpoint's config.json names it so (vLLM's registry maps it to the class above)
        aliases=("LlamaNemotronVLModel",),
    ),
    Architecture(
        "llama-nemotron-vl-rerank", "LlamaNemotronVLForSequenceClassification", build_reference,
        "nvidia/llama-nemotron-rerank-vl-1b-v2",
    ),
)  # fmt: skip
class LlamaNemotronVLProcessor(TiledImageItems, BaseMultiModalProcessor):
    """Processor of the Llama Nemotron VL embedder and reranker (native transform only)."""

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    has_native: ClassVar[bool] = True
    has_hf_transform: ClassVar[bool] = False

    def __init__(self, hf_processor: NemotronVLReference, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        if self.transform != "native":
            raise ValueError(
                "Llama Nemotron VL has no HF processor to call; use transform='native' or 'auto'"
            )
        tokenizer = hf_processor.tokenizer
        self.placeholder_ids: list[int] = tokenizer.encode(
            IMAGE_PLACEHOLDER, add_special_tokens=False
        )
        start, end, context = tokenizer.convert_tokens_to_ids([IMG_START, IMG_END, IMG_CONTEXT])
        self.tile_tokens = (int(start), int(context), int(end))
        #: the context token's id, as vLLM's items carry it (``WireForm.image_token_id``)
        self.img_context_id = int(context)

    @classmethod
    def load_hf_processor(cls, path: str, **kwargs: Any) -> NemotronVLReference:
        """The reference of a model folder (no transformers processor exists):
        :meth:`NemotronVLReference.from_pretrained`."""
        return NemotronVLReference.from_pretrained(path, **kwargs)

    @property
    def ref(self) -> NemotronVLReference:
        """The reference parameters (held as ``hf_processor``)."""
        return self.hf_processor

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        return _TILE_KWARGS

    def _tile_params(self, hf_kwargs: Mapping[str, Any]) -> _TileParams:
        # use_thumbnail is not a kwarg (allowed_hf_kwargs): always the reference's.
        params = resolve_params(_TileParams, self.ref, hf_kwargs)
        if not 1 <= params.min_num <= params.max_num:
            raise ProcessorKwargsError(
                "need 1 <= min_dynamic_patch <= max_dynamic_patch, got "
                f"{params.min_num}, {params.max_num}"
            )
        return params

    # the transform --------------------------------------------------------------------------

    def tile_image(self, image: Any, params: _TileParams) -> torch.Tensor:
        """One image -> uint8 tiles ``[n, 3, size, size]`` (the thumbnail last)."""
        size = self.ref.image_size
        rgb = to_rgb_array(image)
        height, width = rgb.shape[:2]
        cols, rows = select_tile_grid(
            width, height, image_size=size, min_num=params.min_num, max_num=params.max_num
        )
        chw = resize(rgb, rows * size, cols * size, Resample.BICUBIC, Backend.PIL)
        tiles = split_tiles(chw, rows, cols)
        if params.use_thumbnail and rows * cols != 1:
            thumbnail = resize(rgb, size, size, Resample.BICUBIC, Backend.PIL)
            tiles = torch.cat([tiles, thumbnail.unsqueeze(0)])
        return tiles

    def _cpu_normalize(self, tiles: torch.Tensor) -> torch.Tensor:
        # The reference's ToTensor (x / 255) then Normalize (sub mean, div std), in fp32.
        ref = self.ref
        mean = torch.tensor(ref.image_mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(ref.image_std, dtype=torch.float32).view(-1, 1, 1)
        return tiles.to(torch.float32).div(255).sub_(mean).div_(std)

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._tile_params(hf_kwargs)
        per_image = [self.tile_image(image, params) for image in hf_data.get("images", [])]
        if not per_image:
            return {}
        pixel_values = torch.cat(per_image) if len(per_image) > 1 else per_image[0]
        if not self.device_normalize:
            pixel_values = self._cpu_normalize(pixel_values)
        counts = np.array([len(t) for t in per_image], dtype=np.int64)
        return {"pixel_values": pixel_values, "image_num_patches": torch.from_numpy(counts)}

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        params = self._tile_params(hf_kwargs)
        cols, rows = select_tile_grid(
            width, height, image_size=self.ref.image_size,
            min_num=params.min_num, max_num=params.max_num,
        )  # fmt: skip
        tiles = rows * cols + (1 if params.use_thumbnail and rows * cols != 1 else 0)
        return planned_item("image", image_num_patches=torch.tensor(tiles, dtype=torch.long))

    # fields, updates, normalisation ---------------------------------------------------------

    @property
    def tokens_per_tile(self) -> int:
        return self.ref.num_image_token

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        ref = self.ref
        return NormalizationParams(
            ref.rescale_factor, ref.image_mean, ref.image_std, ChannelLayout.NCHW
        )
