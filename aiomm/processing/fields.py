"""Per-item views of a processor's batched output, and the contract every field config keeps.

An HF processor returns one batch for all items of a request (e.g. Qwen's ``pixel_values`` rows of
every image concatenated). A field config says how one output key splits into one entry per item
and how entries merge back, so a cache can store and reuse single items and merge them in any
combination, independently of how the original batch was formed or padded.

Every field config implements :class:`FieldConfig`: ``split`` (batch -> items), ``merge`` (items
-> batch), ``concat_parts`` (the merge as a concatenation the device stage's one copy can do, or
None) with ``repeat`` (rows stored compact, expanded by :class:`Repeat`, the only definition of the
frame repeat), and ``finish`` (a merged batch after the device stage normalised it). The engine and
the device stage use nothing else.
"""

from __future__ import annotations

import abc
import enum
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from aiomm.errors import KernelInputError, ProcessingError
from aiomm.kernels import expand_repeat

__all__ = (
    "FeatureFramesField",
    "FieldConfig",
    "FieldKind",
    "MultiModalFieldConfig",
    "MultiModalKwargsItem",
    "PaddedImageField",
    "PaddedPatchesField",
    "Parts",
    "Repeat",
    "concat_parts",
    "merge_items",
    "split_items",
)


class Repeat(NamedTuple):
    """Rows stored compact: each of a row's ``blocks`` equal blocks stands for ``times`` copies.

    Qwen-VL's image rows hold the frame ``temporal_patch_size`` times per channel; items and the
    cache keep one copy (1/times of the bytes) and the merge (or the device stage's one copy)
    writes the others.
    """

    blocks: int
    times: int

    def expand(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` ``[n, blocks * width]`` as a view ``[n, blocks, times, width]`` whose
        flattening after dim 0 is the model's rows.

        :raises ProcessingError: rows that do not split into ``blocks`` equal blocks.
        """
        try:
            return expand_repeat(value, self)
        except KernelInputError:
            raise ProcessingError(
                f"rows of shape {list(value.shape)} do not split into {self.blocks} equal blocks"
            ) from None

    def expand_array(self, value: np.ndarray) -> np.ndarray:
        """:meth:`expand` of a numpy array (a broadcast view): the same layout, with no torch call
        (each releases the GIL, see :mod:`aiomm.processing.image_ops`).

        :raises ProcessingError: rows that do not split into ``blocks`` equal blocks.
        """
        if self.blocks < 1 or self.times < 1 or value.ndim != 2 or value.shape[1] % self.blocks:
            raise ProcessingError(
                f"rows of shape {list(value.shape)} do not split into {self.blocks} equal blocks"
            )
        n, width = value.shape[0], value.shape[1] // self.blocks
        return np.broadcast_to(
            value.reshape(n, self.blocks, 1, width), (n, self.blocks, self.times, width)
        )

    def expanded_width(self, width: int) -> int:
        """The width of a model row made from a compact row of ``width`` values."""
        return width * self.times


class FieldConfig(abc.ABC):
    """How one output key splits into items of ``modality`` and merges back.

    Subclasses implement :meth:`split` and :meth:`merge`; the defaults of the rest say "no
    concatenation, no repeat, nothing to finish".
    """

    modality: str
    #: compact rows (see :class:`Repeat`); None when values are stored as the model takes them
    repeat: Repeat | None = None

    @abc.abstractmethod
    def split(self, key: str, value: Any) -> list[Any]:
        """Split a batch into per-item values.

        :raises ProcessingError: if the value does not fit the config.
        """

    @abc.abstractmethod
    def merge(self, values: Sequence[Any]) -> Any:
        """Merge per-item values into one batch (the inverse of :meth:`split`)."""

    def expanded(self, value: torch.Tensor) -> torch.Tensor:
        """A stored value as the model takes it (a view; the value itself without ``repeat``)."""
        return value if self.repeat is None else self.repeat.expand(value)

    def concat_parts(self, values: Sequence[Any]) -> list[torch.Tensor] | None:
        """Tensors whose concatenation along dim 0 (each :meth:`expanded`) is
        ``merge(values)``, or None when the merge is not such a concatenation.

        A consumer that copies the batch anyway (the device stage) merges in that one copy.
        """
        return None

    def finish(self, batch: torch.Tensor, values: Sequence[Any]) -> torch.Tensor:
        """``merge(values)`` after the device stage normalised it: whatever the merge filled
        in (padding) gets the value the reference batch has there."""
        return batch


class FieldKind(enum.Enum):
    BATCHED = "batched"  #: item i is ``data[i]``; merged by stacking
    FLAT = "flat"  #: item i is a run of ``sizes[i]`` along dim 0; merged by concatenation
    SHARED = "shared"  #: the same value for every item; merged by taking one


@dataclass(frozen=True)
class MultiModalFieldConfig(FieldConfig):
    """A batched, flat or shared field (see :class:`FieldKind`)."""

    kind: FieldKind
    modality: str
    sizes: tuple[int, ...] | None = None
    batch_size: int | None = None
    #: compact rows of a flat field, expanded on merge (see :class:`Repeat`)
    repeat: Repeat | None = None

    @staticmethod
    def batched(modality: str) -> MultiModalFieldConfig:
        return MultiModalFieldConfig(FieldKind.BATCHED, modality)

    @staticmethod
    def flat_from_sizes(
        modality: str,
        sizes: Sequence[int] | torch.Tensor,
        *,
        repeat: tuple[int, int] | None = None,
    ) -> MultiModalFieldConfig:
        if isinstance(sizes, torch.Tensor):
            sizes = sizes.tolist()
        if repeat is not None and (repeat[0] < 1 or repeat[1] < 1):
            raise ProcessingError(f"repeat must be (blocks >= 1, times >= 1), got {repeat}")
        return MultiModalFieldConfig(
            FieldKind.FLAT,
            modality,
            sizes=tuple(int(s) for s in sizes),
            repeat=None
            if repeat is None or repeat[1] == 1
            else Repeat(int(repeat[0]), int(repeat[1])),
        )

    @staticmethod
    def shared(modality: str, batch_size: int) -> MultiModalFieldConfig:
        return MultiModalFieldConfig(FieldKind.SHARED, modality, batch_size=batch_size)

    def split(self, key: str, value: Any) -> list[Any]:
        """Split ``value`` into per-item values.

        :raises ProcessingError: if the value's length does not fit the config.
        """
        if self.kind is FieldKind.BATCHED:
            if isinstance(value, torch.Tensor):
                # indexing, not list(): iterating a tensor calls unbind, which releases the GIL
                # (image_ops' module docstring); indexing showed no GIL waits under perf sched
                return [value[i] for i in range(len(value))]
            return list(value)
        if self.kind is FieldKind.SHARED:
            assert self.batch_size is not None
            return [value] * self.batch_size
        assert self.sizes is not None
        total = sum(self.sizes)
        if len(value) != total:
            raise ProcessingError(
                f"field {key!r} has {len(value)} rows but its item sizes {list(self.sizes)} "
                f"add up to {total}"
            )
        out: list[Any] = []
        start = 0
        for size in self.sizes:
            out.append(value[start : start + size])
            start += size
        return out

    def merge(self, values: Sequence[Any]) -> Any:
        """Merge per-item values back into one batch (the inverse of :meth:`split`); rows stored
        compact (``repeat``) are expanded in the same copy."""
        if self.kind is FieldKind.SHARED:
            return values[0]
        if self.repeat is not None and all(isinstance(v, torch.Tensor) for v in values):
            return torch.cat([self.repeat.expand(v) for v in values]).flatten(1)
        tensors = all(isinstance(v, torch.Tensor) for v in values)
        if tensors and self.kind is FieldKind.BATCHED:
            # items of different shapes (Qwen3-Omni's per-clip masks) stay a list, as in vLLM
            if len({tuple(v.shape) for v in values}) == 1:
                return torch.stack(list(values))
            return list(values)
        if tensors:
            return torch.cat(list(values))
        if self.kind is FieldKind.BATCHED:
            return list(values)
        return [x for v in values for x in v]

    def concat_parts(self, values: Sequence[Any]) -> list[torch.Tensor] | None:
        """See :meth:`FieldConfig.concat_parts`; None for shared or non-tensor values.

        :raises ProcessingError: batched values of different shapes (they cannot be stacked).
        """
        if self.kind is FieldKind.SHARED or not values:
            return None
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        if self.kind is FieldKind.BATCHED:
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ProcessingError(f"batched values of different shapes: {sorted(shapes)}")
            return [v.unsqueeze(0) for v in values]
        return list(values)


@dataclass(frozen=True)
class PaddedImageField(FieldConfig):
    """A padded image batch: ``[N, C, H, W]``, image ``i`` in its top-left ``sizes[i]`` corner,
    zeros elsewhere (or a list of ``[C, h_i, w_i]`` tensors).

    :meth:`split` crops each image to its own size (an independent copy, so a cached item holds
    no reference to the batch); :meth:`merge` pads the items to the largest height and width with
    zeros and stacks them, reproducing the padded batch of any combination of items; :meth:`finish`
    puts the zeros back after the device stage normalised the padding along with the pixels.
    """

    modality: str
    #: (height, width) of each image of the batch being split; merging does not use them
    sizes: tuple[tuple[int, int], ...]

    def split(self, key: str, value: Any) -> list[torch.Tensor]:
        """Crop each image of ``value`` to its size.

        :raises ProcessingError: if ``value`` does not hold one image per size.
        """
        if len(value) != len(self.sizes):
            raise ProcessingError(
                f"field {key!r} has {len(value)} images but {len(self.sizes)} image sizes"
            )
        out = []
        shares_batch = isinstance(value, torch.Tensor) and len(self.sizes) > 1
        for image, (h, w) in zip(value, self.sizes, strict=True):
            image = torch.as_tensor(image)
            if image.shape[-2] < h or image.shape[-1] < w:
                raise ProcessingError(
                    f"field {key!r}: image of shape {tuple(image.shape)} is smaller than its "
                    f"size {h}x{w}"
                )
            crop = image[..., :h, :w]
            if shares_batch or crop.shape != image.shape:
                crop = crop.clone(memory_format=torch.contiguous_format)
            out.append(crop)
        return out

    def merge(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pad every image to the largest height and width (bottom, right) and stack them."""
        height = max(int(v.shape[-2]) for v in values)
        width = max(int(v.shape[-1]) for v in values)
        first = values[0]
        out = first.new_zeros((len(values), *first.shape[:-2], height, width))
        for i, v in enumerate(values):
            out[i, ..., : v.shape[-2], : v.shape[-1]] = v
        return out

    def finish(self, batch: torch.Tensor, values: Sequence[Any]) -> torch.Tensor:
        """Zero the padding of ``batch`` (normalised uint8 zeros are ``-mean / std``)."""
        for i, v in enumerate(values):
            h, w = int(v.shape[-2]), int(v.shape[-1])
            batch[i, ..., h:, :] = 0
            batch[i, ..., :h, w:] = 0
        return batch


@dataclass(frozen=True)
class PaddedPatchesField(MultiModalFieldConfig):
    """A batch of patch stacks padded to its most patches: ``[N, P, C, H, W]``, image ``i``'s
    ``counts[i]`` patches first and zero patches after them (or a list of ``[n_i, C, H, W]``).

    A batched field whose :meth:`split` keeps each image's own patches (an independent copy),
    whose :meth:`merge` pads them to the most patches again and stacks them (HF's batch for any
    combination of items), and whose :meth:`finish` puts the zero patches back after the device
    stage normalised them.
    """

    kind: FieldKind = FieldKind.BATCHED
    modality: str = "image"
    #: patches of each image of the batch being split; merging does not use them
    counts: tuple[int, ...] = field(default=())

    def split(self, key: str, value: Any) -> list[Any]:
        """Each image's own patches.

        :raises ProcessingError: ``value`` does not hold one patch stack per count.
        """
        if len(value) != len(self.counts):
            raise ProcessingError(
                f"field {key!r} has {len(value)} images but {len(self.counts)} patch counts"
            )
        out = []
        for stack, n in zip(value, self.counts, strict=True):
            stack = torch.as_tensor(stack)
            if stack.shape[0] < n:
                raise ProcessingError(
                    f"field {key!r}: {stack.shape[0]} patches where the image has {n}"
                )
            if stack.shape[0] != n or isinstance(value, torch.Tensor):
                stack = stack[:n].clone(memory_format=torch.contiguous_format)
            out.append(stack)
        return out

    def merge(self, values: Sequence[Any]) -> torch.Tensor:
        """Pad every stack to the most patches (zero patches after its own) and stack them."""
        most = max(int(v.shape[0]) for v in values)
        first = values[0]
        out = first.new_zeros((len(values), most, *first.shape[1:]))
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out

    def concat_parts(self, values: Sequence[Any]) -> list[torch.Tensor] | None:
        return None

    def finish(self, batch: torch.Tensor, values: Sequence[Any]) -> torch.Tensor:
        """Zero the padding patches of ``batch`` (normalised uint8 zeros are ``-mean / std``)."""
        for i, v in enumerate(values):
            batch[i, int(v.shape[0]) :] = 0
        return batch


@dataclass(frozen=True)
class FeatureFramesField(FieldConfig):
    """Feature frames flat along dim 1: the batch ``[mels, sum(sizes)]``, item ``i`` its own
    ``[mels, sizes[i]]`` run of frames (vLLM's ``flat_from_sizes(..., dim=1)``)."""

    modality: str
    sizes: tuple[int, ...]
    #: the dim the items' frames run along (the wire's ``dim``)
    dim: int = 1

    def split(self, key: str, value: Any) -> list[Any]:
        """Each item's frames, an independent copy.

        :raises ProcessingError: frames that do not add up to the sizes.
        """
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise ProcessingError(f"field {key!r} is not a [mels, frames] tensor")
        if value.shape[1] != sum(self.sizes):
            raise ProcessingError(
                f"field {key!r} has {value.shape[1]} frames but its item sizes "
                f"{list(self.sizes)} add up to {sum(self.sizes)}"
            )
        bounds = np.cumsum((0, *self.sizes)).tolist()
        return [value[:, a:b].clone() for a, b in itertools.pairwise(bounds)]

    def merge(self, values: Sequence[Any]) -> Any:
        return torch.cat(list(values), dim=1)


@dataclass
class MultiModalKwargsItem:
    """The processor output of one item: its modality and, per key, its value and field config.

    ``prompt_data``: JSON data the item's prompt update reads that is no model input (Qwen3-VL's
    and GLM-V's frame timestamps); cached with the item, never merged into the model's kwargs.
    """

    modality: str
    data: dict[str, Any]
    fields: dict[str, FieldConfig] = field(repr=False)
    prompt_data: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes held by this item's tensors (what a cache counts)."""
        return sum(v.nbytes for v in self.data.values() if isinstance(v, torch.Tensor))


def split_items(
    outputs: Mapping[str, Any], fields_config: Mapping[str, FieldConfig]
) -> dict[str, list[MultiModalKwargsItem]]:
    """Split batched processor outputs into per-item entries, grouped by modality.

    Keys without a config are dropped (text outputs, for instance).

    :raises ProcessingError: if the keys of one modality disagree on the item count.
    """
    per_modality: dict[str, dict[str, list[Any]]] = {}
    for key, config in fields_config.items():
        if key in outputs:
            per_modality.setdefault(config.modality, {})[key] = config.split(key, outputs[key])
    result: dict[str, list[MultiModalKwargsItem]] = {}
    for modality, values in per_modality.items():
        counts = {key: len(v) for key, v in values.items()}
        if len(set(counts.values())) != 1:
            raise ProcessingError(f"the {modality} fields disagree on the item count: {counts}")
        n = next(iter(counts.values()))
        result[modality] = [
            MultiModalKwargsItem(
                modality,
                {key: v[i] for key, v in values.items()},
                {key: fields_config[key] for key in values},
            )
            for i in range(n)
        ]
    return result


def merge_items(
    items: Sequence[MultiModalKwargsItem], *, skip: Collection[str] = ()
) -> dict[str, Any]:
    """Merge items (of one or several modalities, in order) into model-ready batched kwargs,
    leaving out the keys in ``skip``."""
    by_key: dict[str, list[Any]] = {}
    configs: dict[str, FieldConfig] = {}
    for item in items:
        for key, value in item.data.items():
            if key in skip:
                continue
            by_key.setdefault(key, []).append(value)
            configs.setdefault(key, item.fields[key])
    return {key: configs[key].merge(values) for key, values in by_key.items()}


class Parts(NamedTuple):
    """A field's per-item tensors, to concatenate along dim 0 after expanding each by
    ``repeat`` (see :class:`Repeat`)."""

    tensors: list[torch.Tensor]
    repeat: Repeat | None


def concat_parts(items: Sequence[MultiModalKwargsItem], key: str) -> Parts | None:
    """``key``'s per-item tensors as :class:`Parts`; None when no item has ``key`` or its merge
    is not a concatenation (see :meth:`FieldConfig.concat_parts`)."""
    values = [item.data[key] for item in items if key in item.data]
    if not values:
        return None
    config = next(item.fields[key] for item in items if key in item.data)
    tensors = config.concat_parts(values)
    return None if tensors is None else Parts(tensors, config.repeat)
