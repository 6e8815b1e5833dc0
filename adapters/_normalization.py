"""Normalisation shared by the adapters whose transform parameters carry ``rescale_factor``,
``image_mean`` and ``image_std`` (read per request against the image processor's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from aiomm.kernels import ChannelLayout
from aiomm.processing.image_ops import Backend, backend_of, hf_backend_normalize
from aiomm.processing.processor import NormalizationParams

__all__ = ("BackendNormalization",)


class BackendNormalization:
    """Mixin (listed before ``BaseMultiModalProcessor``) of adapters over an HF image processor:
    holds it and its backend, and provides the classic path's CPU normalisation through the
    backend's own operations and the device path's ``NormalizationParams``.

    The adapter provides ``_resolve_params(hf_kwargs)`` and the layout its ``pixel_values`` have
    when they reach the device.
    """

    image_processor: Any
    backend: Backend
    pixel_layout: ClassVar[ChannelLayout]

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)  # type: ignore[call-arg]
        self.image_processor = hf_processor.image_processor
        self.backend = backend_of(self.image_processor)

    def _resolve_params(self, hf_kwargs: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def _cpu_normalize(self, chw: torch.Tensor, params: Any) -> torch.Tensor:
        return hf_backend_normalize(
            self.image_processor, self.backend, chw,
            params.rescale_factor, params.image_mean, params.image_std,
        )  # fmt: skip

    def _cpu_normalize_tiles(self, tiles: torch.Tensor, params: Any) -> torch.Tensor:
        """:meth:`_cpu_normalize` of a uint8 ``[n, C, H, W]`` stack: one batched call on the
        torchvision backend (elementwise, so equal to per-tile calls), one per tile on the PIL
        backend (its numpy operations take one ``C x H x W`` image)."""
        if self.backend is Backend.TORCHVISION:
            return self.image_processor.rescale_and_normalize(
                tiles, True, params.rescale_factor, True,
                tuple(params.image_mean), tuple(params.image_std),
            )  # fmt: skip
        return torch.stack([self._cpu_normalize(tile, params) for tile in tiles])

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        p = self._resolve_params(hf_kwargs)
        return NormalizationParams(p.rescale_factor, p.image_mean, p.image_std, self.pixel_layout)
