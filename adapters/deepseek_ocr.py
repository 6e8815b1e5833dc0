"""DeepSeek-OCR and DeepSeek-OCR 2 (images).

Reference: vLLM's ``DeepseekOCRProcessor`` (``vllm/transformers_utils/processors/deepseek_ocr.py``,
vllm-project/vllm), which both models run with ``base_size=1024``, crops on and 2..6 crops:
``DeepseekOCRForCausalLM`` (``vllm/model_executor/models/deepseek_ocr.py``, DeepSeek-OCR's
"Gundam" mode) with ``image_size=640`` and ``strategy="v1"``, ``DeepseekOCR2ForCausalLM``
(``deepseek_ocr2.py``) with ``image_size=768`` and ``strategy="v2"``. It restates the published
preprocessing of ``deepseek-ai/DeepSeek-OCR`` and ``deepseek-ai/DeepSeek-OCR-2``
(``process/image_process.py``). transformers' ``DeepseekOcr2ImageProcessor`` restates the second
too, but is not what vLLM runs and differs from it: it centres the padded global view with
``(side - w) // 2`` where Pillow's ``ImageOps.pad`` rounds half to even, and its torchvision
backend resizes with torch's antialiased bicubic, not Pillow's. So, as for Llama Nemotron VL,
:func:`build_reference` returns a :class:`DeepseekOCRReference` (the tokenizer, built in code with
the model's special tokens, and the published parameters) and only the ``native`` transform
exists; it equals vLLM's processor bit for bit whatever the backend.

The transform, per image (RGB, uint8):

1. local views, only when the image exceeds ``image_size`` on a side and crops are on: the
   ``(cols, rows)`` grid with ``min_crops <= cols * rows <= max_crops`` whose aspect ratio is
   closest to the image's (a tie goes to the later grid when the image covers more than half of
   its area; grids ordered by tile count as vLLM's set orders them), a Pillow bicubic resize to
   ``(cols * image_size, rows * image_size)`` cut row-major into ``image_size`` squares;
2. the global view: with crops off the image is first resized to ``image_size`` square; then
   Pillow's ``ImageOps.pad`` to ``base_size`` square (bicubic resize of the longer side to
   ``base_size``, the other ``round``-ed, pasted centred, ``round``-ed half to even, on grey
   ``int(0.5 * 255) = 127``);
3. ``ToTensor`` (``/ 255``) and ``Normalize(0.5, 0.5)`` in float32; vLLM casts to the model's
   dtype (bfloat16) on the wire.

Items (vLLM's fields): ``pixel_values`` the global view ``[3, base, base]`` (batched),
``images_crop`` the local views ``[n, 3, image_size, image_size]`` (flat; ``n = 0`` for an
untiled image) and ``images_spatial_crop`` ``[cols, rows]`` (batched, kept on the CPU; ``[1, 1]``
untiled). Each ``<image>`` becomes a run of ``<image>`` tokens, every one an embedding: with
``q = ceil((side // 16) / 4)`` queries a side (16 for the global view, 10 or 12 for a local one),
strategy v2 counts ``q * q`` for the global view, one separator and ``(rows q) x (cols q)`` for a
tiled image's local views (256 + 1 + 144 cols rows); strategy v1 adds a newline query to every
row of both (16 x 17 + 1 + (10 rows) x (10 cols + 1)). vLLM counts them from the image size
with the fixed parameters, whatever processor kwargs a trusting server
(``--trust-request-mm-kwargs``) passed on, and so does this adapter. Those kwargs are
``crop_mode`` (False: DeepSeek-OCR's "Base"/"Large" modes, no crops), ``base_size``,
``image_size`` and ``max_crops``.

vLLM's model takes normalised pixels (no ``--mm-device-do-normalize``): the default keeps them
on the host. With ``mm_device_do_normalize=True`` the global view stays uint8 for the device
stage and the local views are normalised here (the device stage normalises ``pixel_values``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._params import resolve_params
from aiomm.adapters.nemotron_vl import count_ordered_grids, split_tiles
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
    image_size,
    planned_item,
)
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate

__all__ = (
    "DEEPSEEK_OCR_SPECIAL_TOKENS",
    "DeepseekOCRProcessor",
    "DeepseekOCRReference",
    "build_reference",
    "build_reference_v1",
    "global_view_geometry",
    "num_image_tokens",
    "register_config",
    "select_crop_grid",
)

IMAGE_TOKEN = "<image>"
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
#: DeepSeek's sentence and padding tokens and the image token (the checkpoint's tokenizer)
DEEPSEEK_OCR_SPECIAL_TOKENS = (BOS, EOS, PAD, IMAGE_TOKEN)

_KWARGS = frozenset({"crop_mode", "base_size", "image_size", "max_crops"})


#: the parameters vLLM's ``DeepseekOCRProcessor`` takes per architecture (beyond the defaults)
_ARCHITECTURE_PARAMS: dict[str, dict[str, Any]] = {
    "DeepseekOCRForCausalLM": {"image_size": 640, "strategy": "v1"},
    "DeepseekOCR2ForCausalLM": {},
}


@dataclass(frozen=True)
class DeepseekOCRReference:
    """The preprocessing parameters vLLM runs a DeepSeek-OCR model with, and its tokenizer (no
    HF processor: see the module docstring). The defaults are DeepSeek-OCR 2's."""

    tokenizer: Any
    #: the side of a local view (vLLM's ``IMAGE_SIZE``: 640 for DeepSeek-OCR, 768 for OCR 2)
    image_size: int = 768
    #: the side of the global view
    base_size: int = 1024
    crop_mode: bool = True
    min_crops: int = 2
    max_crops: int = 6
    patch_size: int = 16
    downsample_ratio: int = 4
    #: vLLM's token layout: "v1" (DeepSeek-OCR) ends every row of queries with a newline query
    strategy: str = "v2"
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the tokenizer into the folder ``path`` (vLLM fixes the parameters)."""
        self.tokenizer.save_pretrained(str(path))

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> DeepseekOCRReference:
        """The folder's tokenizer with the parameters vLLM gives the architecture its
        ``config.json`` names (DeepSeek-OCR 2's without one); ``overrides`` win.

        :raises OSError: the folder has no tokenizer.
        """
        from transformers import AutoTokenizer

        register_config()
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        params: dict[str, Any] = {}
        config = Path(path) / "config.json"
        if config.is_file():
            for name in json.loads(config.read_text()).get("architectures") or ():
                params = _ARCHITECTURE_PARAMS.get(name, params)
        return cls(tokenizer=tokenizer, **{**params, **overrides})


@functools.cache
def register_config() -> None:
    """Let transformers read a DeepSeek-OCR ``config.json`` (``model_type`` ``deepseek_vl_v2``,
    which only the checkpoints' remote code and vLLM define): a config class holding its
    ``vision_config``, ``projector_config`` and ``language_config`` as vLLM's
    ``DeepseekVLV2Config`` nests them, registered with ``AutoConfig`` unless transformers has
    one."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    if "deepseek_vl_v2" in CONFIG_MAPPING:
        return

    class DeepseekVLV2Config(PretrainedConfig):
        """DeepSeek-VL2 / DeepSeek-OCR's config: the three parts kept as their fields."""

        model_type = "deepseek_vl_v2"

        def __init__(
            self,
            vision_config: dict[str, Any] | None = None,
            projector_config: dict[str, Any] | None = None,
            language_config: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            self.vision_config = PretrainedConfig(**(vision_config or {}))
            self.projector_config = PretrainedConfig(**(projector_config or {}))
            self.language_config = PretrainedConfig(**(language_config or {}))
            super().__init__(**kwargs)

    AutoConfig.register("deepseek_vl_v2", DeepseekVLV2Config)


def build_reference(backend: str = "pil", **overrides: Any) -> DeepseekOCRReference:
    """DeepSeek-OCR 2's reference parameters with an offline tokenizer (one transform whatever
    ``backend``); ``overrides`` win."""
    if backend not in ("pil", "torchvision"):
        raise ValueError(f"unknown backend {backend!r}")
    register_config()
    tokenizer = build_tokenizer(DEEPSEEK_OCR_SPECIAL_TOKENS, eos_token=EOS)
    tokenizer.bos_token, tokenizer.pad_token = BOS, PAD
    return DeepseekOCRReference(tokenizer=tokenizer, **overrides)


def build_reference_v1(backend: str = "pil", **overrides: Any) -> DeepseekOCRReference:
    """DeepSeek-OCR's reference parameters (640-px local views, strategy v1) with an offline
    tokenizer; ``overrides`` win."""
    params = {**_ARCHITECTURE_PARAMS["DeepseekOCRForCausalLM"], **overrides}
    return build_reference(backend, **params)


def select_crop_grid(
    width: int, height: int, *, image_size: int, min_num: int, max_num: int
) -> tuple[int, int]:
    """The ``(cols, rows)`` grid of local views vLLM picks for a ``width x height`` image."""
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in count_ordered_grids(min_num, max_num):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)
    return best


def global_view_geometry(width: int, height: int, side: int) -> tuple[int, int, int, int]:
    """``(new_width, new_height, left, top)`` of Pillow's ``ImageOps.pad`` of a ``width x
    height`` image into a ``side`` square: the resized size (``ImageOps.contain``) and where it
    is pasted."""
    new_w, new_h = side, side
    ratio = width / height
    if ratio != 1:
        if ratio > 1:
            new_h = round(height / width * side)
        else:
            new_w = round(width / height * side)
    return new_w, new_h, round((side - new_w) * 0.5), round((side - new_h) * 0.5)


def num_image_tokens(width: int, height: int, ref: DeepseekOCRReference) -> int:
    """vLLM's token count of a ``width x height`` image (``get_num_image_tokens`` of the
    reference's strategy): the global view's queries, one separator, the local views' queries;
    strategy v1 adds a newline query to every row."""
    cols, rows = 1, 1
    if width > ref.image_size or height > ref.image_size:
        cols, rows = select_crop_grid(
            width, height, image_size=ref.image_size, min_num=ref.min_crops, max_num=ref.max_crops
        )
    newline = int(ref.strategy == "v1")
    base = math.ceil((ref.base_size // ref.patch_size) / ref.downsample_ratio)
    local = math.ceil((ref.image_size // ref.patch_size) / ref.downsample_ratio)
    tiled = (rows * local) * (cols * local + newline) if cols > 1 or rows > 1 else 0
    return base * (base + newline) + 1 + tiled


@dataclass(frozen=True)
class _CropParams:
    """Read from the request's kwargs, else the reference's parameters (``resolve_params``)."""

    crop_mode: bool
    base_size: int
    image_size: int
    max_crops: int


@register(
    Architecture(
        "deepseek-ocr-2", "DeepseekOCR2ForCausalLM", build_reference, "deepseek-ai/DeepSeek-OCR-2"
    ),
    Architecture(
        "deepseek-ocr", "DeepseekOCRForCausalLM", build_reference_v1, "deepseek-ai/DeepSeek-OCR"
    ),
)
class DeepseekOCRProcessor(BaseMultiModalProcessor):
    """Processor of DeepSeek-OCR and DeepSeek-OCR 2 (native transform only)."""

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder({"image": IMAGE_TOKEN})
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True
    has_hf_transform: ClassVar[bool] = False

    def __init__(self, hf_processor: DeepseekOCRReference, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        if self.transform != "native":
            raise ValueError(
                "DeepSeek-OCR has no HF processor to call; use transform='native' or 'auto'"
            )
        self.image_token_id = int(hf_processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))

    @classmethod
    def load_hf_processor(cls, path: str, **kwargs: Any) -> DeepseekOCRReference:
        """The reference of a model folder (vLLM's processor is no transformers class):
        :meth:`DeepseekOCRReference.from_pretrained`."""
        return DeepseekOCRReference.from_pretrained(path, **kwargs)

    @property
    def ref(self) -> DeepseekOCRReference:
        """The reference parameters (held as ``hf_processor``)."""
        return self.hf_processor

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        return _KWARGS

    def _crop_params(self, hf_kwargs: Mapping[str, Any]) -> _CropParams:
        params = resolve_params(_CropParams, self.ref, hf_kwargs)
        if params.base_size < 1 or params.image_size < 1:
            raise ProcessorKwargsError(
                f"base_size and image_size must be positive, got {params.base_size}, "
                f"{params.image_size}"
            )
        return params

    def _grid(self, width: int, height: int, params: _CropParams) -> tuple[int, int]:
        """The image's ``(cols, rows)`` of local views; ``(1, 1)``: none."""
        size = params.image_size
        if not params.crop_mode or (width <= size and height <= size):
            return 1, 1
        return select_crop_grid(
            width, height, image_size=size, min_num=self.ref.min_crops, max_num=params.max_crops
        )

    # the transform --------------------------------------------------------------------------

    def views(
        self, image: Any, params: _CropParams
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One image -> its uint8 global view ``[3, base, base]``, local views ``[n, 3, size,
        size]`` and ``[cols, rows]``."""
        rgb = to_rgb_array(image)
        height, width = rgb.shape[:2]
        size = params.image_size
        cols, rows = self._grid(width, height, params)
        if cols * rows > 1:
            chw = resize(rgb, rows * size, cols * size, Resample.BICUBIC, Backend.PIL)
            local = split_tiles(chw, rows, cols).contiguous()
        else:
            local = torch.empty((0, 3, size, size), dtype=torch.uint8)
        if not params.crop_mode:
            rgb = resize(rgb, size, size, Resample.BICUBIC, Backend.PIL).permute(1, 2, 0).numpy()
            height, width = size, size
        side = params.base_size
        new_w, new_h, left, top = global_view_geometry(width, height, side)
        grey = int(self.ref.image_mean[0] * 255)
        canvas = torch.full((3, side, side), grey, dtype=torch.uint8)
        if new_w and new_h:
            canvas[:, top : top + new_h, left : left + new_w] = resize(
                rgb, new_h, new_w, Resample.BICUBIC, Backend.PIL
            )
        return canvas, local, [cols, rows]

    def _cpu_normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        # The reference's ToTensor (x / 255) then Normalize (sub mean, div std), in fp32.
        ref = self.ref
        mean = torch.tensor(ref.image_mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(ref.image_std, dtype=torch.float32).view(-1, 1, 1)
        return pixels.to(torch.float32).div(255).sub_(mean).div_(std)

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._crop_params(hf_kwargs)
        per_image = [self.views(image, params) for image in hf_data.get("images", [])]
        if not per_image:
            return {}
        pixel_values = torch.stack([g for g, _, _ in per_image])
        crops = torch.cat([c for _, c, _ in per_image])
        if not self.device_normalize:
            pixel_values = self._cpu_normalize(pixel_values)
        # the device stage normalises pixel_values only: the local views are model input here
        crops = self._cpu_normalize(crops)
        spatial = np.array([s for _, _, s in per_image], dtype=np.int64)
        return {
            "pixel_values": pixel_values,
            "images_crop": crops,
            "images_spatial_crop": torch.from_numpy(spatial),
        }

    def _set_prompt_data(
        self,
        mm_items: Mapping[str, list[Any]],
        items: Mapping[str, list[MultiModalKwargsItem]],
    ) -> None:
        for image, item in zip(mm_items.get("image", []), items.get("image", []), strict=True):
            height, width = image_size(image)
            item.prompt_data["tokens"] = num_image_tokens(width, height, self.ref)

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        params = self._crop_params(hf_kwargs)
        cols, rows = self._grid(width, height, params)
        return planned_item(
            "image",
            {"tokens": num_image_tokens(width, height, self.ref)},
            images_spatial_crop=[cols, rows],
        )

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        spatial = outputs.get("images_spatial_crop")
        grids = [] if spatial is None else spatial.tolist()
        sizes = [cols * rows if cols * rows > 1 else 0 for cols, rows in grids]
        return {
            "pixel_values": MultiModalFieldConfig.batched("image"),
            "images_crop": MultiModalFieldConfig.flat_from_sizes("image", sizes),
            "images_spatial_crop": MultiModalFieldConfig.batched("image"),
        }

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        token = self.image_token_id

        def replacement(i: int) -> list[int]:
            return [token] * int(items[i].prompt_data["tokens"])

        return [PromptReplacement("image", [token], replacement)]

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        ref = self.ref
        return NormalizationParams(
            ref.rescale_factor, ref.image_mean, ref.image_std, ChannelLayout.NCHW
        )
