"""The multimodal processor: reproduces an HF processor's output from token ids and items.

The HF processor expands placeholders in *text*; serving stacks tokenize first, so aiomm never sees
the text. A processor here therefore

1. runs the image transform (four overridable stages, mirroring vLLM's design):
   ``_get_hf_mm_inputs`` -> ``_call_hf_processor`` -> ``_finalize_hf_mm_data`` ->
   ``_postprocess_hf_mm_data``, composed by ``process_items``;
2. splits the batched output into per-item entries (``_get_mm_fields_config``), the unit a cache
   stores;
3. applies the model's prompt updates to the token ids (``_postprocess_prompt`` first, then
   ``_get_prompt_updates``) and finds each item's placeholder range.

:meth:`BaseMultiModalProcessor.process_items` is step 1-2 (expensive, cacheable per item) and
:meth:`BaseMultiModalProcessor.assemble` is step 3 (cheap); :meth:`apply` runs both.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import PIL.Image
import torch

from aiomm.config import MultiModalConfig as MultiModalConfig
from aiomm.config import TransformMode as TransformMode
from aiomm.errors import (
    PixelValueRoundingError,
    ProcessingError,
    ProcessorKwargsError,
    UnknownModalityError,
)
from aiomm.kernels import ChannelLayout, FusedMMInputNorm
from aiomm.logging import get_logger
from aiomm.media.video import SampledVideo
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import (
    FieldConfig,
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    merge_items,
    split_items,
)
from aiomm.processing.placeholders import PlaceholderRange
from aiomm.processing.prompt_updates import PromptUpdate, apply_and_find

__all__ = (
    "BaseMultiModalProcessor",
    "MultiModalConfig",
    "NormalizationParams",
    "ProcessedInputs",
    "planned_item",
)

log = get_logger(__name__)

# Our modality names -> the keyword an HF processor takes them under.
_HF_DATA_KEYS = {"image": "images", "video": "videos", "audio": "audios"}
_TEXT_OUTPUT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


@dataclass(frozen=True)
class NormalizationParams:
    """What ``FusedMMInputNorm`` needs to turn uint8 ``pixel_values`` into model input."""

    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    layout: ChannelLayout

    def module(self) -> FusedMMInputNorm:
        return FusedMMInputNorm(self.rescale_factor, list(self.image_mean), list(self.image_std))


@dataclass
class ProcessedInputs:
    """The result of :meth:`BaseMultiModalProcessor.apply`.

    ``mm_kwargs`` holds one entry per item (per modality, in item order); ``merged_kwargs()``
    batches them as the model takes them. ``normalization`` is set when ``pixel_values`` are
    uint8 and still need normalising on the device; None when they are already normalised.
    """

    prompt_token_ids: list[int]
    mm_placeholders: dict[str, list[PlaceholderRange]]
    mm_kwargs: dict[str, list[MultiModalKwargsItem]]
    normalization: NormalizationParams | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def merged_kwargs(self) -> dict[str, Any]:
        """Per-item outputs merged into batched model kwargs."""
        return merge_items([item for items in self.mm_kwargs.values() for item in items])


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _writable_arrays(value: Any) -> Any:
    """Copies of read-only numpy arrays (decoded images are views of Pillow's bytes): HF's
    torch backend wraps arrays with ``torch.from_numpy``, which warns on read-only memory."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    if isinstance(value, list):
        return [_writable_arrays(v) for v in value]
    return value


def check_uint8_exact(name: str, values: torch.Tensor) -> torch.Tensor:
    """Return ``values`` as uint8, proving no value was rounded or clipped.

    :raises PixelValueRoundingError: if any value is not an integer in 0..255.
    """
    if values.dtype == torch.uint8:
        return values
    if values.is_floating_point():
        exact = bool(torch.equal(values, values.round()))
    else:
        exact = True
    if not exact or (values.numel() and (values.min() < 0 or values.max() > 255)):
        raise PixelValueRoundingError(
            f"{name} ({values.dtype}, shape {tuple(values.shape)}) is not exactly representable "
            "as uint8; the transform rescaled or normalised despite do_rescale=False, "
            "do_normalize=False"
        )
    return values.to(torch.uint8)


class BaseMultiModalProcessor:
    """Base class of every adapter's processor.

    Subclasses set ``supported_modalities`` and ``dummy_inputs`` (None: the HF processor is
    called without text) and implement ``_get_mm_fields_config``, ``_get_prompt_updates`` and
    ``_get_normalization_params``; those with a native transform implement
    ``_call_native_transform`` and set ``has_native = True``.

    Optional hooks, each overridden by an adapter today: ``_get_hf_mm_inputs`` (processor
    kwargs rewritten for the HF call), ``_postprocess_hf_mm_data`` (outputs that are not one
    tensor, e.g. unpadded images), ``_set_prompt_data`` (what an item's prompt update reads that
    is no model input, e.g. frame timestamps) and ``_postprocess_prompt`` (prompt-only edits).
    ``_call_hf_processor`` and ``_finalize_hf_mm_data`` are stages 2 and 3 of the design; no
    adapter overrides them (stage 2 dispatches to ``_call_native_transform``, stage 3 merges
    stage 1's passthrough data), but they stay the seams where a processor whose HF call or
    outputs differ plugs in, as vLLM's processors do.
    """

    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)
    dummy_inputs: ClassVar[BaseDummyInputsBuilder | None]
    default_device_normalize: ClassVar[bool] = True
    has_native: ClassVar[bool] = False
    #: whether the native transform is a plain resize + patchify that can run on the device
    supports_device_resize: ClassVar[bool] = False
    #: where the native transform resizes (None: on the CPU); set by the engine
    resize_device: torch.device | None = None
    #: audio adapters: the rate (Hz) their feature extractor takes, and vLLM's resampling
    #: method to it (:data:`aiomm.media.audio.RESAMPLE_METHODS`)
    audio_sampling_rate: int = 16000
    audio_resample_method: ClassVar[str] = "torchaudio"

    def __init__(self, hf_processor: Any, *, config: MultiModalConfig | None = None) -> None:
        self.hf_processor = hf_processor
        self.config = config or MultiModalConfig()
        flag = self.config.mm_device_do_normalize
        self.device_normalize: bool = self.default_device_normalize if flag is None else flag
        mode = self.config.transform
        if mode == "native" and not self.has_native:
            raise ValueError(f"{type(self).__name__} has no native transform; use 'hf' or 'auto'")
        self.transform: Literal["hf", "native"] = (
            ("native" if self.has_native else "hf") if mode == "auto" else mode
        )

    @classmethod
    def load_hf_processor(cls, path: str, **kwargs: Any) -> Any:
        """The HF processor of the local model folder ``path`` (``AutoProcessor``, offline);
        ``kwargs`` go to ``from_pretrained``. An adapter whose model has no transformers
        processor overrides it.

        :raises OSError: the folder lacks the processor's files.
        """
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path, local_files_only=True, **kwargs)

    def resize_target(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> tuple[int, int] | None:
        """The ``(height, width)`` the native transform resizes a ``height x width`` image to
        under ``hf_kwargs``, known before decoding; None when this adapter cannot say (the HF
        transform, or no native one). The transform of a
        :class:`~aiomm.processing.image_ops.ReducedImage` resizes to the
        target of its source size: ``DecodeConfig(fidelity="fast")`` needs both.

        :raises ItemRejectedError: the adapter rejects an image of that size.
        """
        return None

    # ------------------------------------------------------------------ routing plans

    def plan_image(
        self, height: int, width: int, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem | None:
        """The item of a ``height x width`` image (as decoded) without its pixels: the fields
        its prompt update reads, equal to the processed item's (``Engine.plan``). None: this
        adapter cannot plan, the image is processed instead.

        :raises ItemRejectedError, ProcessingError: what processing the image would raise for
            its size and ``hf_kwargs``.
        """
        return None

    def plan_video(
        self, video: SampledVideo, hf_kwargs: Mapping[str, Any]
    ) -> MultiModalKwargsItem | None:
        """As :meth:`plan_image`, for a video's sampled frames (their count and size)."""
        return None

    # ------------------------------------------------------------------ public API

    def apply(
        self,
        prompt_token_ids: Sequence[int],
        mm_data: Mapping[str, Any],
        hf_processor_mm_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """Process ``mm_data`` and expand its placeholders in ``prompt_token_ids``.

        :raises UnknownModalityError: for a modality this adapter does not handle.
        :raises ItemCountMismatchError: if items and placeholders differ in number.
        :raises PromptUpdateError: if a prompt update cannot be applied.
        :raises ProcessorKwargsError: for processor kwargs the processor does not take.
        """
        hf_kwargs = dict(hf_processor_mm_kwargs or {})
        mm_items = self.normalize_mm_data(mm_data)
        items = self.process_items(mm_items, hf_kwargs)
        return self.assemble(prompt_token_ids, items, hf_kwargs)

    def normalize_mm_data(self, mm_data: Mapping[str, Any]) -> dict[str, list[Any]]:
        """Check modalities and turn each value into a list of items."""
        mm_items: dict[str, list[Any]] = {}
        for modality, value in mm_data.items():
            if modality not in self.supported_modalities:
                raise UnknownModalityError(modality, self.supported_modalities)
            items = _as_list(value)
            if items:
                mm_items[modality] = items
        return mm_items

    def process_items(
        self,
        mm_items: Mapping[str, list[Any]],
        hf_kwargs: Mapping[str, Any],
        *,
        validated: bool = False,
    ) -> dict[str, list[MultiModalKwargsItem]]:
        """Run the transform on every item and split the result into per-item entries.

        ``validated``: the caller already checked ``hf_kwargs`` with :meth:`validate_hf_kwargs`
        (the engine does, once per request, before any item is loaded).

        :raises ProcessorKwargsError: for processor kwargs the processor does not take.
        """
        if not validated:
            self.validate_hf_kwargs(hf_kwargs)
        if not any(mm_items.values()):
            return {}
        hf_data, kwargs, passthrough = self._get_hf_mm_inputs(mm_items, hf_kwargs)
        processed = self._call_hf_processor(hf_data, kwargs) if hf_data else None
        data = self._finalize_hf_mm_data(processed, passthrough)
        outputs = self._postprocess_hf_mm_data(data, kwargs)
        items = split_items(outputs, self._get_mm_fields_config(outputs, hf_kwargs))
        self._set_prompt_data(mm_items, items)
        return items

    def assemble(
        self,
        prompt_token_ids: Sequence[int],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
        hf_kwargs: Mapping[str, Any] | None = None,
        *,
        normalization: bool = True,
    ) -> ProcessedInputs:
        """Apply prompt updates for already processed items (fresh or from a cache);
        ``normalization=False`` leaves ``ProcessedInputs.normalization`` None (no pixels to
        normalise: a routing plan)."""
        hf_kwargs = dict(hf_kwargs or {})
        prompt = self._postprocess_prompt(list(prompt_token_ids))
        counts = {m: len(items) for m, items in mm_kwargs.items()}
        updates = self._get_prompt_updates(counts, hf_kwargs, mm_kwargs)
        new_prompt, placeholders = apply_and_find(prompt, updates, counts)
        return ProcessedInputs(
            prompt_token_ids=new_prompt,
            mm_placeholders=placeholders,
            mm_kwargs=dict(mm_kwargs),
            normalization=self._get_normalization_params(hf_kwargs)
            if self.device_normalize and normalization
            else None,
        )

    def validate_hf_kwargs(self, hf_kwargs: Mapping[str, Any]) -> None:
        """Reject kwargs the processor would ignore or misread.

        :raises ProcessorKwargsError: naming the unknown keys and the accepted ones.
        """
        allowed = self.allowed_hf_kwargs()
        unknown = sorted(set(hf_kwargs) - allowed)
        if unknown:
            raise ProcessorKwargsError(
                f"{type(self).__name__} does not accept processor kwargs {unknown}; "
                f"accepted: {sorted(allowed)}"
            )

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The processor kwargs this adapter accepts (by default the image processor's)."""
        image_processor = getattr(self.hf_processor, "image_processor", None)
        typed = getattr(image_processor, "valid_kwargs", None)
        if typed is None:
            return frozenset()
        keys = set(getattr(typed, "__required_keys__", ())) | set(
            getattr(typed, "__optional_keys__", ())
        )
        # Owned by aiomm: the normalise mode and the output format are not per-request options.
        return frozenset(keys - {"do_rescale", "do_normalize", "return_tensors", "device"})

    # ------------------------------------------------------------------ the four HF stages

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Stage 1: processor data (with ``dummy_inputs``' text), processor kwargs and
        passthrough data."""
        hf_data = {_HF_DATA_KEYS.get(m, m): list(items) for m, items in mm_items.items()}
        if "audios" in hf_data:
            hf_data["audio"] = hf_data.pop("audios")
        kwargs = dict(hf_kwargs)
        if self.device_normalize:
            kwargs.update(do_rescale=False, do_normalize=False)
        counts = {m: len(items) for m, items in mm_items.items()}
        text = None if self.dummy_inputs is None else self.dummy_inputs.get_dummy_text(counts)
        if text is not None:
            hf_data["text"] = [text]
            kwargs["truncation"] = False
        return hf_data, kwargs, {}

    def _call_hf_processor(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        """Stage 2: run the transform (the HF processor, or the native one)."""
        if self.transform == "native":
            return self._call_native_transform(hf_data, hf_kwargs)
        hf_data = {key: _writable_arrays(value) for key, value in hf_data.items()}
        try:
            return self.hf_processor(**hf_data, **hf_kwargs, return_tensors="pt")
        except (TypeError, ValueError, KeyError) as exc:
            raise ProcessingError(
                f"{type(self.hf_processor).__name__} rejected the request "
                f"({type(exc).__name__}): {exc}"
            ) from exc

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no native transform")

    def _finalize_hf_mm_data(
        self, processed: Any, passthrough: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Stage 3: merge passthrough fields; an empty output when nothing was processed."""
        data = {} if processed is None else dict(processed)
        data.update(passthrough)
        return data

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Stage 4: drop the dummy text's outputs; prove uint8 pixels exact."""
        for key in _TEXT_OUTPUT_KEYS:
            data.pop(key, None)
        if self.device_normalize:
            for key in ("pixel_values", "pixel_values_videos"):
                if key in data:
                    value = data[key]
                    if not isinstance(value, torch.Tensor):
                        value = torch.as_tensor(value)
                    data[key] = check_uint8_exact(key, value)
        return data

    # ------------------------------------------------------------------ per-model hooks

    def _postprocess_prompt(self, token_ids: list[int]) -> list[int]:
        """Prompt-only transforms the HF processor applies regardless of the items."""
        return token_ids

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> Mapping[str, FieldConfig]:
        raise NotImplementedError

    def _set_prompt_data(
        self,
        mm_items: Mapping[str, list[Any]],
        items: Mapping[str, list[MultiModalKwargsItem]],
    ) -> None:
        """Fill each processed item's ``prompt_data`` from its input (what its prompt update
        needs that is no model input, e.g. frame timestamps). By default nothing."""

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        raise NotImplementedError

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def clone(self) -> BaseMultiModalProcessor:
        """A copy with its own HF processor (HF fast tokenizers are not thread-safe)."""
        new = copy.copy(self)
        new.hf_processor = copy.deepcopy(self.hf_processor)
        return new


def planned_item(
    modality: str, prompt_data: Mapping[str, Any] | None = None, **fields: Any
) -> MultiModalKwargsItem:
    """A routing plan's item: ``fields`` (lists become int64 tensors, as the processed item
    holds them) and ``prompt_data``, no pixels."""
    data = {
        # (through numpy: a third of torch.tensor's cost for a few ints)
        key: torch.from_numpy(np.array(value, dtype=np.int64)) if isinstance(value, list) else value
        for key, value in fields.items()
    }
    return MultiModalKwargsItem(
        modality,
        data,
        {key: MultiModalFieldConfig.batched(modality) for key in data},
        dict(prompt_data or {}),
    )


def image_size(image: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or an ``H x W [x C]`` array."""
    if isinstance(image, PIL.Image.Image):
        return image.height, image.width
    shape = np.shape(image)
    return int(shape[0]), int(shape[1])


def prod(values: Sequence[int] | torch.Tensor) -> int:
    return int(math.prod(int(v) for v in values))
