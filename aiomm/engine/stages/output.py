"""The output stage: a request's processed items -> the model's batched kwargs on the device.

Input: :class:`~aiomm.processing.processor.ProcessedInputs`. Output: a dict of batched tensors,
``pixel_values`` normalised to ``visual_dtype`` on the engine's device. Every key is merged by its
field config (the :class:`~aiomm.processing.fields.FieldConfig` contract); the pixels are merged
inside the device stage's one host copy where their merge is a concatenation, and finished by
their field config afterwards (padding back to the reference's zeros). The device stage bounds
its own work (its threads and staging buffers); this stage runs on the event loop.
"""

from __future__ import annotations

from typing import Any

import anyio

from aiomm.device.stage import DeviceStage
from aiomm.processing.fields import FieldConfig, MultiModalKwargsItem
from aiomm.processing.processor import ProcessedInputs

from ._stage import Stage

__all__ = ("PIXEL_KEYS", "OutputStage")

#: the keys whose values the device stage normalises (``ProcessedInputs.normalization``)
PIXEL_KEYS = frozenset({"pixel_values", "pixel_values_videos"})


class OutputStage(Stage):
    """Merges items into model kwargs; the pixels go through the device stage."""

    name = "output"

    def __init__(self, device: DeviceStage) -> None:
        super().__init__(None)
        self.device = device

    async def run(self, processed: ProcessedInputs) -> dict[str, Any]:
        """The batched model kwargs of ``processed``.

        :raises KernelInputError: pixels the device stage cannot take (see
            :meth:`~aiomm.device.stage.DeviceStage.run`).
        """
        with self.counted():
            items = [item for group in processed.mm_kwargs.values() for item in group]
            values: dict[str, list[Any]] = {}
            configs: dict[str, FieldConfig] = {}
            for item in items:
                _collect(item, values, configs)
            merged: dict[str, Any] = {}
            for key, vals in values.items():
                config = configs[key]
                if key not in PIXEL_KEYS:
                    merged[key] = config.merge(vals)
                    continue
                parts = config.concat_parts(vals)
                pixels = await self.device.run(
                    config.merge(vals) if parts is None else parts,
                    processed.normalization,
                    repeat=None if parts is None else config.repeat,
                )
                merged[key] = config.finish(pixels, vals)
            return merged

    async def run_host(self, processed: ProcessedInputs) -> dict[str, Any]:
        """The batched model kwargs of ``processed`` left on the CPU as the transform made them.

        ``pixel_values`` keep the transform's dtype (uint8 when the adapter normalises on the
        device), merged in the model's layout (compact rows expanded), not normalised.
        """
        with self.counted():
            # a request's rows are megabytes: merge them off the event loop
            return await anyio.to_thread.run_sync(
                processed.merged_kwargs, limiter=self.device.workers
            )


def _collect(
    item: MultiModalKwargsItem, values: dict[str, list[Any]], configs: dict[str, FieldConfig]
) -> None:
    for key, value in item.data.items():
        values.setdefault(key, []).append(value)
        configs.setdefault(key, item.fields[key])
