"""Per-item views of a processor's batched output.

An HF processor returns one batch for all items of a request (e.g. Qwen's ``pixel_values`` rows of
every image concatenated). Field configs say how each key splits into one entry per item, so a
cache can store and reuse single items and merge them back in any combination, independently of
how the original batch was formed or padded.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from aiomm.errors import ProcessingError

__all__ = (
    "FieldKind",
    "MultiModalFieldConfig",
    "MultiModalKwargsItem",
    "Parts",
    "concat_parts",
    "merge_items",
    "split_items",
)


class FieldKind(enum.Enum):
    BATCHED = "batched"  #: item i is ``data[i]``; merged by stacking
    FLAT = "flat"  #: item i is a run of ``sizes[i]`` along dim 0; merged by concatenation
    SHARED = "shared"  #: the same value for every item; merged by taking one


@dataclass(frozen=True)
class MultiModalFieldConfig:
    """How one output key splits into items of ``modality``."""

    kind: FieldKind
    modality: str
    sizes: tuple[int, ...] | None = None
    batch_size: int | None = None
    #: ``(blocks, times)``: rows are stored compact, and merging repeats each of a row's
    #: ``blocks`` equal blocks ``times`` times in place (Qwen-VL's image rows hold the frame
    #: ``temporal_patch_size`` times per channel): items and the cache keep 1/times of the bytes.
    repeat: tuple[int, int] | None = None

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
            repeat=None if repeat is None or repeat[1] == 1 else (int(repeat[0]), int(repeat[1])),
        )

    @staticmethod
    def shared(modality: str, batch_size: int) -> MultiModalFieldConfig:
        return MultiModalFieldConfig(FieldKind.SHARED, modality, batch_size=batch_size)

    def split(self, key: str, value: Any) -> list[Any]:
        """Split ``value`` into per-item values.

        :raises ProcessingError: if the value's length does not fit the config.
        """
        if self.kind is FieldKind.BATCHED:
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

    def expanded(self, value: torch.Tensor) -> torch.Tensor:
        """A stored value as the model takes it: a view ``[rows, blocks, times, width]`` whose
        flattening after dim 0 is the model's rows (the value itself without ``repeat``).

        :raises ProcessingError: rows that do not split into ``blocks`` equal blocks.
        """
        if self.repeat is None:
            return value
        blocks, times = self.repeat
        if value.dim() != 2 or value.shape[1] % blocks:
            raise ProcessingError(
                f"rows of shape {list(value.shape)} do not split into {blocks} equal blocks"
            )
        n, width = value.shape[0], value.shape[1] // blocks
        return value.view(n, blocks, 1, width).expand(n, blocks, times, width)

    def merge(self, values: Sequence[Any]) -> Any:
        """Merge per-item values back into one batch (the inverse of :meth:`split`); rows stored
        compact (``repeat``) are expanded in the same copy."""
        if self.kind is FieldKind.SHARED:
            return values[0]
        if self.repeat is not None and all(isinstance(v, torch.Tensor) for v in values):
            return torch.cat([self.expanded(v) for v in values]).flatten(1)
        if all(isinstance(v, torch.Tensor) for v in values):
            return (
                torch.stack(list(values))
                if self.kind is FieldKind.BATCHED
                else torch.cat(list(values))
            )
        if self.kind is FieldKind.BATCHED:
            return list(values)
        return [x for v in values for x in v]

    def concat_parts(self, values: Sequence[Any]) -> list[torch.Tensor] | None:
        """Tensors whose concatenation along dim 0 is ``merge(values)`` (once each is
        :meth:`expanded`, when ``repeat`` is set), or None when the merge is not a concatenation
        of tensors (shared or non-tensor values).

        A consumer that copies the batch anyway (the device stage) merges in that one copy.

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


@dataclass
class MultiModalKwargsItem:
    """The processor output of one item: its modality and, per key, its value and field config."""

    modality: str
    data: dict[str, Any]
    fields: dict[str, MultiModalFieldConfig] = field(repr=False)

    def nbytes(self) -> int:
        """Bytes held by this item's tensors (what a cache counts)."""
        return sum(v.nbytes for v in self.data.values() if isinstance(v, torch.Tensor))


def split_items(
    outputs: Mapping[str, Any], fields_config: Mapping[str, MultiModalFieldConfig]
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
    configs: dict[str, MultiModalFieldConfig] = {}
    for item in items:
        for key, value in item.data.items():
            if key in skip:
                continue
            by_key.setdefault(key, []).append(value)
            configs.setdefault(key, item.fields[key])
    return {key: configs[key].merge(values) for key, values in by_key.items()}


class Parts(NamedTuple):
    """A field's per-item tensors, to concatenate along dim 0 after expanding each by
    ``repeat`` (see :attr:`MultiModalFieldConfig.repeat`)."""

    tensors: list[torch.Tensor]
    repeat: tuple[int, int] | None


def concat_parts(items: Sequence[MultiModalKwargsItem], key: str) -> Parts | None:
    """``key``'s per-item tensors as :class:`Parts`; None when no item has ``key`` or its merge
    is not a concatenation (see :meth:`MultiModalFieldConfig.concat_parts`)."""
    values = [item.data[key] for item in items if key in item.data]
    if not values:
        return None
    config = next(item.fields[key] for item in items if key in item.data)
    tensors = config.concat_parts(values)
    return None if tensors is None else Parts(tensors, config.repeat)
