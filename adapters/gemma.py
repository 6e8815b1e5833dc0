"""Gemma 3 (``Gemma3ForConditionalGeneration``), images, with pan-and-scan.

Reference: transformers' ``Gemma3Processor`` with ``Gemma3ImageProcessor`` (torchvision backend)
or ``Gemma3ImageProcessorPil`` (PIL backend), as ``google/gemma-3-4b-it`` configures them: SigLIP
at 896 x 896, bilinear, mean/std 0.5, 256 soft tokens per image. The checkpoints leave the
pan-and-scan parameters null, so the processor's own defaults hold (off; crops of at least 256
pixels, at most 4, for aspect ratios from 1.2): both the HF processor and vLLM's read a request's
kwargs over those defaults and never the image processor's attributes.

The transform, per image: convert to RGB; with ``do_pan_and_scan``, cut an image whose long side
exceeds ``pan_and_scan_min_ratio_to_activate`` times its short side into ``n`` crops along the
long side (``n``: the aspect ratio rounded half up, at most ``long / min_crop_size``, clamped to
``2..max_num_crops``; crop sides are the ceiling of ``side / n`` and the last crop is cut short;
no crops if a crop would be smaller than ``min_crop_size``); resize the whole image and then each
crop to ``size`` (torchvision: antialiased bilinear; PIL: Pillow's); rescale/normalise, on the
CPU by default (vLLM's Gemma 3 takes normalised pixels, sent as bfloat16). An item is
``pixel_values`` ``[1 + crops, 3, 896, 896]`` (a flat field) and ``num_patches`` ``1 + crops``
(batched, kept on the CPU), as vLLM's processor lays them out.

Prompt: each ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>" + <image_soft_token> x 256
+ "<end_of_image>\\n\\n"``; with crops, ``"Here is the original image {seq} and here are some
crops to help you see better {seq} {seq}..."``, tokenized as vLLM tokenizes it (the folder's
tokenizer). Only the soft tokens take embeddings. vLLM then merges the newline tokens next to
each other (``\\n`` + ``\\n\\n`` and ``\\n\\n`` + ``\\n`` into ``\\n\\n\\n``, ``\\n\\n`` +
``\\n\\n`` into ``\\n\\n\\n\\n``, in that order, as its tokenizer encodes such runs) and
finds each item's range in the merged prompt with those tokens split again, mapping each range's
start back; :meth:`Gemma3MultiModalProcessor.assemble` does the same. A range so keeps its
unmerged length: it reaches one token past the item's own for each merge inside it (between
pan-and-scan crops, where the word tokenizer drops the space), and two images with nothing
between them both hold their merged ``\\n\\n\\n\\n``. Where two ranges so overlap (adjacent
images, or fewer tokens between two images than merges inside the first),
vLLM's render server refuses the request (400), and so does this processor
(:class:`~aiomm.errors.ItemRejectedError`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters._normalization import BackendNormalization
from aiomm.adapters._params import resolve_params
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ItemRejectedError, ProcessorKwargsError, PromptUpdateError
from aiomm.kernels import ChannelLayout
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import FieldConfig, MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.image_ops import Resample, resize, to_rgb_array
from aiomm.processing.placeholders import PlaceholderRange
from aiomm.processing.processor import (
    BaseMultiModalProcessor,
    ProcessedInputs,
    check_uint8_exact,
    image_size,
    planned_item,
)
from aiomm.processing.prompt_updates import (
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    apply_and_find,
    find_mm_placeholders,
)

__all__ = (
    "PROCESSOR_DEFAULTS",
    "Gemma3MultiModalProcessor",
    "PanAndScan",
    "merge_newlines",
    "pan_and_scan_crops",
)

BOI, EOI, IMAGE_SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
GEMMA3_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", BOI, EOI, IMAGE_SOFT_TOKEN,
)  # fmt: skip
#: Gemma's tokenizer has one token for each run of up to four newlines (vLLM looks them up)
NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
IMAGE_PLACEHOLDER = BOI

#: ``Gemma3Processor``'s image kwargs defaults (the checkpoints' image processor leaves them null)
PROCESSOR_DEFAULTS: Mapping[str, Any] = {
    "do_convert_rgb": True,
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
_KWARGS = frozenset({
    "size", "resample", "do_convert_rgb", "rescale_factor", "image_mean", "image_std",
    "do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
})  # fmt: skip


@dataclass(frozen=True)
class PanAndScan:
    """Pan-and-scan parameters (``Gemma3Processor``'s defaults unless a request sets them)."""

    do_pan_and_scan: bool
    pan_and_scan_min_crop_size: int
    pan_and_scan_max_num_crops: int
    pan_and_scan_min_ratio_to_activate: float


def pan_and_scan_crops(
    height: int, width: int, params: PanAndScan
) -> list[tuple[int, int, int, int]]:
    """The ``(top, left, height, width)`` crops pan-and-scan cuts from a ``height x width`` image
    (row-major; the last row or column cut short at the border), as
    ``Gemma3ImageProcessor.pan_and_scan`` cuts them; none when it is off or does not activate."""
    if not params.do_pan_and_scan:
        return []
    min_crop, ratio = params.pan_and_scan_min_crop_size, params.pan_and_scan_min_ratio_to_activate
    long_side, short_side = max(height, width), min(height, width)
    if long_side / short_side < ratio:
        return []
    n = min(math.floor(long_side / min_crop), math.floor(long_side / short_side + 0.5))
    n = min(params.pan_and_scan_max_num_crops, max(2, n))
    rows, cols = (1, n) if width >= height else (n, 1)
    crop_h, crop_w = math.ceil(height / rows), math.ceil(width / cols)
    if min(crop_h, crop_w) < min_crop:
        return []
    return [
        (top, left, min(crop_h, height - top), min(crop_w, width - left))
        for top, left in itertools.product(
            [crop_h * i for i in range(rows)], [crop_w * i for i in range(cols)]
        )
    ]


def merge_newlines(tokens: list[int], nl: Sequence[int]) -> list[int]:
    """vLLM's Gemma 3 merge of adjacent newline tokens after expanding the placeholders:
    ``[\\n, \\n\\n]`` then ``[\\n\\n, \\n]`` into ``\\n\\n\\n``, then ``[\\n\\n, \\n\\n]`` into
    ``\\n\\n\\n\\n``, each a left-to-right non-overlapping pass (``nl``: the ids of one to four
    newlines)."""
    for pair, merged in (((nl[0], nl[1]), nl[2]), ((nl[1], nl[0]), nl[2]), ((nl[1], nl[1]), nl[3])):
        out: list[int] = []
        i = 0
        while i < len(tokens):
            if i + 1 < len(tokens) and (tokens[i], tokens[i + 1]) == pair:
                out.append(merged)
                i += 2
            else:
                out.append(tokens[i])
                i += 1
        tokens = out
    return tokens


# -------------------------------------------------------------------------- offline builder

# google/gemma-3-4b-it's preprocessor_config.json and processor_config.json.
GEMMA3_IMAGE_PARAMS: dict[str, Any] = {
    "size": {"height": 896, "width": 896},
    "resample": 2,
    "rescale_factor": 1 / 255,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
GEMMA3_PROCESSOR_PARAMS: dict[str, Any] = {"image_seq_length": 256}


def build_gemma3_tokenizer() -> Any:
    """Gemma 3's special tokens, the image tokens as its tokenizer names them, and the
    newline-run tokens, on the offline word-level tokenizer."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(GEMMA3_SPECIAL_TOKENS, eos_token="<eos>")
    base.add_tokens(list(NEWLINES))
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        unk_token="<unk>", eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_SOFT_TOKEN, "boi_token": BOI, "eoi_token": EOI},
    )  # fmt: skip


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``Gemma3Processor`` of Gemma 3 4B, with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.Gemma3ImageProcessor,
        "pil": transformers.Gemma3ImageProcessorPil,
    }[backend]
    return transformers.Gemma3Processor(
        image_processor=image_cls(**{**GEMMA3_IMAGE_PARAMS, **overrides}),
        tokenizer=build_gemma3_tokenizer(),
        **GEMMA3_PROCESSOR_PARAMS,
    )


@dataclass(frozen=True)
class _TransformParams:
    height: int
    width: int
    resample: Resample
    do_convert_rgb: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


@register(
    Architecture(
        "gemma3", "Gemma3ForConditionalGeneration", build_hf_processor, "google/gemma-3-4b-it"
    )
)
class Gemma3MultiModalProcessor(BackendNormalization, BaseMultiModalProcessor):
    """Processor of Gemma 3 (``Gemma3Processor``), images with optional pan-and-scan."""

    pixel_layout: ClassVar[ChannelLayout] = ChannelLayout.NCHW

    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"image": IMAGE_PLACEHOLDER}
    )
    # vLLM's Gemma 3 takes normalised pixels (its model does not normalise on the device)
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        tokenizer = hf_processor.tokenizer
        vocab = tokenizer.get_vocab()
        self.boi_token_id = int(vocab[hf_processor.boi_token])
        self.image_token_id = int(vocab[tokenizer.image_token])
        self.newline_ids = tuple(int(vocab[n]) for n in NEWLINES)
        self.full_image_sequence: str = hf_processor.full_image_sequence
        #: by crop count (a handful per processor)
        self._image_tokens: dict[int, PromptUpdateDetails] = {}

    # kwargs ---------------------------------------------------------------------------------

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image kwargs the transform reads (``do_resize`` is not one: every image and crop
        is resized to ``size``)."""
        return super().allowed_hf_kwargs() & _KWARGS

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        ip = self.image_processor
        size = hf_kwargs.get("size", ip.size)
        get = size.get if isinstance(size, Mapping) else lambda k, d=None: getattr(size, k, d)
        height, width = get("height", None), get("width", None)
        if not height or not width:
            raise ProcessorKwargsError("Gemma 3 needs size={'height': h, 'width': w}")
        kwargs = {"do_convert_rgb": PROCESSOR_DEFAULTS["do_convert_rgb"], **hf_kwargs}
        return resolve_params(_TransformParams, ip, kwargs, height=int(height), width=int(width))

    def pan_and_scan_params(self, hf_kwargs: Mapping[str, Any]) -> PanAndScan:
        """The request's pan-and-scan parameters over the processor's defaults.

        :raises ProcessorKwargsError: a crop size or crop count below 1.
        """
        params = resolve_params(PanAndScan, None, {**PROCESSOR_DEFAULTS, **hf_kwargs})
        if params.do_pan_and_scan and (
            params.pan_and_scan_min_crop_size < 1 or params.pan_and_scan_max_num_crops < 1
        ):
            raise ProcessorKwargsError(
                "pan_and_scan_min_crop_size and pan_and_scan_max_num_crops must be at least 1"
            )
        return params

    def num_patches(self, height: int, width: int, hf_kwargs: Mapping[str, Any]) -> int:
        """The image plus its pan-and-scan crops."""
        return 1 + len(pan_and_scan_crops(height, width, self.pan_and_scan_params(hf_kwargs)))

    # the transform --------------------------------------------------------------------------

    def transform_image(
        self, image: Any, params: _TransformParams, pas: PanAndScan
    ) -> torch.Tensor:
        """One image -> ``[1 + crops, C, H, W]`` pixels (uint8, or normalised on the classic
        path): the whole image, then its crops."""
        rgb = to_rgb_array(image) if params.do_convert_rgb else np.asarray(image)
        views = [rgb] + [
            rgb[top : top + h, left : left + w]
            for top, left, h, w in pan_and_scan_crops(rgb.shape[0], rgb.shape[1], pas)
        ]
        patches = []
        for view in views:
            chw = resize(view, params.height, params.width, params.resample, self.backend)
            patches.append(chw if self.device_normalize else self._cpu_normalize(chw, params))
        return torch.stack(patches)

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        images = hf_data.get("images") or []
        if images:
            # vLLM's processor counts each image's crops from its size (HF's count is dropped)
            counts = [self.num_patches(*image_size(image), hf_kwargs) for image in images]
            passthrough["num_patches"] = torch.tensor(counts, dtype=torch.long)
        return hf_data, kwargs, passthrough

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        params = self._resolve_params(hf_kwargs)
        pas = self.pan_and_scan_params(hf_kwargs)
        per_image = [
            self.transform_image(image, params, pas) for image in hf_data.get("images", [])
        ]
        if not per_image:
            return {}
        return {"pixel_values": torch.cat(per_image) if len(per_image) > 1 else per_image[0]}

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        data.pop("num_crops", None)
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        if "pixel_values" in data and self.device_normalize:
            data["pixel_values"] = check_uint8_exact("pixel_values", data["pixel_values"])
        return data

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem:
        self._resolve_params(hf_kwargs)  # refuses what processing the image would refuse
        patches = self.num_patches(height, width, hf_kwargs)
        return planned_item("image", num_patches=torch.tensor(patches, dtype=torch.long))

    # fields, updates, normalisation ---------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        counts = outputs.get("num_patches")
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes(
                "image", counts if counts is not None else []
            ),
            "num_patches": MultiModalFieldConfig.batched("image"),
        }

    def image_tokens(self, num_crops: int) -> PromptUpdateDetails:
        """The tokens of an image with ``num_crops`` crops, as vLLM encodes its text."""
        cached = self._image_tokens.get(num_crops)
        if cached is not None:
            return cached
        if num_crops == 0:
            text = BOI
        else:
            crops = " ".join(BOI for _ in range(num_crops))
            text = (
                f"Here is the original image {BOI} and here are some crops to help you see "
                f"better {crops}"
            )
        ids = self.hf_processor.tokenizer.encode(
            text.replace(BOI, self.full_image_sequence), add_special_tokens=False
        )
        details = PromptUpdateDetails.select_token_id(ids, self.image_token_id)
        self._image_tokens[num_crops] = details
        return details

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("image", [])

        def replacement(i: int) -> PromptUpdateDetails:
            return self.image_tokens(int(items[i].data["num_patches"]) - 1)

        return [PromptReplacement("image", [self.boi_token_id], replacement)]

    def assemble(
        self,
        prompt_token_ids: Sequence[int],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
        hf_kwargs: Mapping[str, Any] | None = None,
        *,
        normalization: bool = True,
    ) -> ProcessedInputs:
        """Expand the placeholders, merge newline runs and find each item's range as vLLM's
        Gemma 3 processor does (see the module docstring).

        :raises PromptUpdateError: an item's tokens cannot be found after the merge (vLLM
            fails such a prompt too: text after an image that starts with a newline).
        :raises ItemRejectedError: two images with nothing between them (their ranges overlap,
            which vLLM's render server refuses).
        """
        hf_kwargs = dict(hf_kwargs or {})
        prompt = self._postprocess_prompt(list(prompt_token_ids))
        counts = {m: len(items) for m, items in mm_kwargs.items()}
        updates = self._get_prompt_updates(counts, hf_kwargs, mm_kwargs)
        expanded, _ = apply_and_find(prompt, updates, counts)
        merged = merge_newlines(expanded, self.newline_ids)
        placeholders = self._find_merged(merged, updates, counts)
        return ProcessedInputs(
            prompt_token_ids=merged,
            mm_placeholders=placeholders,
            mm_kwargs=dict(mm_kwargs),
            normalization=self._get_normalization_params(hf_kwargs)
            if self.device_normalize and normalization
            else None,
        )

    def _find_merged(
        self, merged: list[int], updates: list[PromptUpdate], counts: Mapping[str, int]
    ) -> dict[str, list[PlaceholderRange]]:
        nl1, nl2, nl3, nl4 = self.newline_ids
        split: list[int] = []
        origin: list[int] = []
        for i, token in enumerate(merged):
            parts = [nl1, nl2] if token == nl3 else [nl2, nl2] if token == nl4 else [token]
            split += parts
            origin += [i] * len(parts)
        found = find_mm_placeholders(split, updates, counts)
        for modality, count in counts.items():
            if count and len(found.get(modality, ())) != count:
                raise PromptUpdateError(
                    f"found {len(found.get(modality, ()))} of {count} {modality} item(s) after "
                    "merging newline tokens; text right after an image may not start with a "
                    "newline"
                )
        placeholders = {
            modality: [PlaceholderRange(origin[r.offset], r.length, r.is_embed) for r in ranges]
            for modality, ranges in found.items()
        }
        ordered = sorted((r for rs in placeholders.values() for r in rs), key=lambda r: r.offset)
        for before, after in itertools.pairwise(ordered):
            if before.offset + before.length > after.offset:
                # vLLM's render server refuses such ranges (400): two images with nothing
                # between them share the merged "\n\n\n\n" token
                raise ItemRejectedError(
                    "image",
                    f"its placeholder range (from token {after.offset}) overlaps the previous "
                    f"image's ({before.length} tokens from {before.offset}) once newline tokens "
                    "merge; put text between adjacent images",
                )
        return placeholders
