"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``: ``moonshotai/Kimi-K2.5``), images.

Reference: vLLM's ``KimiK25FusedVisionProcessor``
(``vllm/transformers_utils/processors/kimi_k25_vision_fused.py``), which vLLM runs for this
model instead of the checkpoint's image processor, with the checkpoint's ``media_proc_cfg``
(``preprocessor_config.json``): patch 14, merge kernel 2, at most 16384 patches and 512 patches a
side, mean and std 0.5. transformers' ``Kimi_K25ImageProcessor`` restates the same geometry but
is not what vLLM runs and differs from it: it resizes with torch's antialiased bicubic where
vLLM uses Pillow's (a 2400 x 2000 image differs by up to 2 in 0.37% of its uint8 values), it has
no PIL backend, and it names the grid ``image_grid_thw`` where vLLM sends ``grid_thws``. So
:func:`build_hf_processor` returns transformers' ``Kimi_K25Processor`` (the tokenizer, built in
code with the model's special tokens, and the published parameters, read from its image
processor) and only the ``native`` transform exists; it equals vLLM's processor bit for bit
whatever the backend.

The transform, per image (RGB, uint8):

1. the scale ``min(1, sqrt(max_patches / (max(1, w // 14) * max(1, h // 14))),
   512 * 14 / w, 512 * 14 / h)``; each side ``int(side * scale)``, at least 1 and at most
   ``512 * 14``;
2. Pillow's bicubic resize to that size, then zero padding (bottom and right) to multiples of
   ``14 * 2 = 28``;
3. cut into 14 x 14 patches, row-major: ``pixel_values`` ``[grid_h * grid_w, 3, 14, 14]``;
   normalised as vLLM's lookup table does (``(v / 255 - mean) * (1 / std)`` in float32; the
   padding is the value 0 normalised).

Items (vLLM's fields): ``pixel_values`` (flat, one slice per image) and ``grid_thws``
``[1, grid_h, grid_w]`` (batched, kept on the CPU). Each ``<|media_pad|>`` becomes
``grid_h * grid_w / 4`` of them, every one an embedding. vLLM sends this model's images as the
``vision_chunk`` modality (the checkpoint's ``use_unified_vision_chunk``): :attr:`wire_modality`.

vLLM's model normalises on the device (``--mm-device-do-normalize``, its default for this
model): uint8 pixels leave the host. Videos are not rendered (vLLM 0.33's processor for this
model has no video chunking).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import PIL.Image
import torch

from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
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
    "KIMI_K25_MEDIA_PROC_CFG",
    "KIMI_K25_SPECIAL_TOKENS",
    "KimiK25MultiModalProcessor",
    "KimiParams",
    "build_hf_processor",
    "navit_size",
)

MEDIA_PAD = "<|media_pad|>"
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
#: the chat and media tokens of the checkpoint's tokenizer that a render request uses
KIMI_K25_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
    "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", MEDIA_PAD,
    VIDEO_PLACEHOLDER,
)  # fmt: skip

#: moonshotai/Kimi-K2.5's preprocessor_config.json (what vLLM's processor reads)
KIMI_K25_MEDIA_PROC_CFG: dict[str, Any] = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
}


@dataclass(frozen=True)
class KimiParams:
    """The image parameters of vLLM's processor (``media_proc_cfg``'s, under transformers'
    names where it has them)."""

    patch_size: int = 14
    #: ``merge_kernel_size``
    merge_size: int = 2
    #: ``in_patch_limit``
    max_patches: int = 16384
    #: ``patch_limit_on_one_side``
    max_side_patches: int = 512
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def of(cls, image_processor: Any) -> KimiParams:
        """The parameters a transformers ``Kimi_K25ImageProcessor`` holds."""
        size = image_processor.size
        side = size["max_height"] if isinstance(size, Mapping) else size.max_height
        return cls(
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            max_patches=int(image_processor.max_patches),
            max_side_patches=int(side),
            image_mean=tuple(float(v) for v in image_processor.image_mean),
            image_std=tuple(float(v) for v in image_processor.image_std),
        )


def navit_size(height: int, width: int, params: KimiParams) -> tuple[int, int, int, int]:
    """``(new_height, new_width, padded_height, padded_width)`` of a ``height x width`` image
    (vLLM's ``navit_resize_image``)."""
    patch = params.patch_size
    s1 = math.sqrt(params.max_patches / (max(1.0, width // patch) * max(1.0, height // patch)))
    s2 = params.max_side_patches * patch / width
    s3 = params.max_side_patches * patch / height
    scale = min(1.0, s1, s2, s3)
    limit = params.max_side_patches * patch
    new_w = min(max(1, int(width * scale)), limit)
    new_h = min(max(1, int(height * scale)), limit)
    factor = params.merge_size * patch
    return (
        new_h,
        new_w,
        new_h + (factor - new_h % factor) % factor,
        new_w + (factor - new_w % factor) % factor,
    )


def _grid(height: int, width: int, params: KimiParams) -> list[int]:
    """``[1, grid_h, grid_w]``: the image's patches (vLLM's ``grid_thws`` row)."""
    _, _, padded_h, padded_w = navit_size(height, width, params)
    return [1, padded_h // params.patch_size, padded_w // params.patch_size]


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """transformers' ``Kimi_K25Processor`` with Kimi-K2.5's parameters and a tokenizer built in
    code (one transform whatever ``backend``: transformers has a torchvision image processor
    only); ``overrides`` go to the image processor."""
    if backend not in ("pil", "torchvision"):
        raise ValueError(f"unknown backend {backend!r}")
    tokenizer = build_tokenizer(KIMI_K25_SPECIAL_TOKENS, eos_token="[EOS]")
    tokenizer.bos_token = "[BOS]"
    return _processor(tokenizer, KIMI_K25_MEDIA_PROC_CFG, overrides)


def _processor(tokenizer: Any, cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> Any:
    """``Kimi_K25Processor`` of ``media_proc_cfg`` ``cfg``; its image processor keeps ``cfg``
    (saved in ``preprocessor_config.json``, where vLLM reads it)."""
    from transformers import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    side = int(cfg["patch_limit_on_one_side"])
    params = {
        "size": {"max_height": side, "max_width": side},
        "max_patches": int(cfg["in_patch_limit"]),
        "patch_size": int(cfg["patch_size"]),
        "merge_size": int(cfg["merge_kernel_size"]),
        "image_mean": list(cfg["image_mean"]),
        "image_std": list(cfg["image_std"]),
        **overrides,
    }
    image_processor = Kimi_K25ImageProcessor(**params)
    # saved with it: vLLM's processor reads only this entry of preprocessor_config.json
    setattr(image_processor, "media_proc_cfg", dict(cfg))  # noqa: B010 (no such attribute)
    return Kimi_K25Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Kimi_K25VideoProcessor(),
    )


def _load(path: str) -> Any:
    """The processor of a model folder: its tokenizer and ``media_proc_cfg``.

    :raises OSError: the folder has no tokenizer or no ``preprocessor_config.json``.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = json.loads((Path(path) / "preprocessor_config.json").read_text())
    cfg = {**KIMI_K25_MEDIA_PROC_CFG, **config.get("media_proc_cfg", {})}
    return _processor(tokenizer, cfg, {})


def _rgb(image: Any) -> np.ndarray:
    """``H x W x 3`` uint8: a PIL image converted as vLLM's processor converts it
    (``Image.convert("RGB")``, any alpha dropped), an array as HF converts one."""
    if isinstance(image, PIL.Image.Image):
        return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    return to_rgb_array(image)


@register(
    Architecture(
        "kimi-k2.5",
        "KimiK25ForConditionalGeneration",
        build_hf_processor,
        "moonshotai/Kimi-K2.5",
    )
)
class KimiK25MultiModalProcessor(BaseMultiModalProcessor):
    """Processor of Kimi-K2.5 (native transform only)."""

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder({"image": MEDIA_PAD})
    has_native: ClassVar[bool] = True
    has_hf_transform: ClassVar[bool] = False
    #: the modality vLLM's render server names this model's image items by
    wire_modality: ClassVar[str] = "vision_chunk"
    #: vLLM's CPU render server runs this model's DeepSeek-V3 text model with MLA, which turns
    #: prefix caching off: with its processor cache off too, it names items by request-counter
    #: ids instead of content hashes (``renderer0-mm-<n>-vision_chunk-<i>``)
    mla_text_model: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        if self.transform != "native":
            raise ValueError(
                "Kimi-K2.5 has no HF transform vLLM runs; use transform='native' or 'auto'"
            )
        self.params = KimiParams.of(hf_processor.image_processor)
        self.media_token_id = int(hf_processor.tokenizer.convert_tokens_to_ids(MEDIA_PAD))

    @classmethod
    def load_hf_processor(cls, path: str, **kwargs: Any) -> Any:
        """The folder's tokenizer and ``media_proc_cfg`` (``preprocessor_config.json``, as vLLM
        reads it) in transformers' ``Kimi_K25Processor``."""
        return _load(path)

    def allowed_hf_kwargs(self) -> frozenset[str]:
        # vLLM's processor for this model takes no per-request image options
        return frozenset()

    # the transform --------------------------------------------------------------------------

    def patches(self, image: Any) -> torch.Tensor:
        """One image -> its uint8 patches ``[grid_h * grid_w, 3, patch, patch]``."""
        rgb = _rgb(image)
        height, width = rgb.shape[:2]
        p = self.params
        new_h, new_w, padded_h, padded_w = navit_size(height, width, p)
        canvas = torch.zeros((3, padded_h, padded_w), dtype=torch.uint8)
        canvas[:, :new_h, :new_w] = resize(rgb, new_h, new_w, Resample.BICUBIC, Backend.PIL)
        patch = p.patch_size
        rows, cols = padded_h // patch, padded_w // patch
        grid = canvas.reshape(3, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)
        return grid.reshape(rows * cols, 3, patch, patch).contiguous()

    def _cpu_normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        # vLLM's lookup table: (v / 255 - mean) * (1 / std), each step in float32
        p = self.params
        values = torch.arange(256, dtype=torch.float32).view(256, 1) / 255.0
        mean = torch.tensor(p.image_mean, dtype=torch.float32).view(1, 3)
        inv_std = 1.0 / torch.tensor(p.image_std, dtype=torch.float32).view(1, 3)
        lut = (values - mean) * inv_std
        channels = torch.arange(3).view(1, 3, 1, 1)
        return lut[pixels.long(), channels]

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        images = hf_data.get("images", [])
        if not images:
            return {}
        per_image = [self.patches(image) for image in images]
        grids = []
        for image in images:
            height, width = image_size(image)
            grids.append(_grid(height, width, self.params))
        pixel_values = torch.cat(per_image)
        if not self.device_normalize:
            pixel_values = self._cpu_normalize(pixel_values)
        return {
            "pixel_values": pixel_values,
            "grid_thws": torch.from_numpy(np.array(grids, dtype=np.int64)),
        }

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        return planned_item("image", grid_thws=_grid(height, width, self.params))

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, MultiModalFieldConfig]:
        grids = outputs.get("grid_thws")
        sizes = [] if grids is None else [int(n) for n in grids.prod(-1).tolist()]
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes),
            "grid_thws": MultiModalFieldConfig.batched("image"),
        }

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])
        token = self.media_token_id
        merge = self.params.merge_size**2

        def replacement(i: int) -> list[int]:
            _, rows, cols = (int(v) for v in items[i].data["grid_thws"].tolist())
            return [token] * (rows * cols // merge)

        return [PromptReplacement("image", [token], replacement)]

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        p = self.params
        return NormalizationParams(1 / 255, p.image_mean, p.image_std, ChannelLayout.NCHW)
