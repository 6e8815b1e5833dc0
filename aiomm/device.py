"""The device stage: uint8 pixel values -> normalised ``visual_dtype`` on the engine's device.

On a CPU-only machine this runs ``FusedMMInputNorm``'s native path in a worker thread; on CUDA
the uint8 tensor crosses to the device (half the bytes of bf16) and the fused Triton kernel
writes ``visual_dtype`` directly. With ``mm_device_do_normalize`` off, pixel values arrive
already normalised on the CPU and are only cast and moved (the classic path).
"""

from __future__ import annotations

import threading

import anyio
import torch

from aiomm.kernels import FusedMMInputNorm
from aiomm.processing.processor import NormalizationParams

__all__ = ("DeviceStage",)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class DeviceStage:
    """Moves and normalises pixel values; the blocking part runs in a worker thread."""

    def __init__(self, device: str, visual_dtype: str) -> None:
        self.device = resolve_device(device)
        self.dtype: torch.dtype = getattr(torch, visual_dtype)
        self.bytes_moved = 0
        self._modules: dict[NormalizationParams, FusedMMInputNorm] = {}
        self._lock = threading.Lock()

    def _module(self, params: NormalizationParams) -> FusedMMInputNorm:
        with self._lock:
            module = self._modules.get(params)
            if module is None:
                module = self._modules[params] = params.module().to(self.device)
            return module

    async def run(
        self, pixel_values: torch.Tensor, params: NormalizationParams | None
    ) -> torch.Tensor:
        """Normalise (or, on the classic path, cast) ``pixel_values`` onto the device."""
        out = await anyio.to_thread.run_sync(self._run_sync, pixel_values, params)
        self.bytes_moved += pixel_values.nbytes if self.device.type != "cpu" else 0
        return out

    def _run_sync(
        self, pixel_values: torch.Tensor, params: NormalizationParams | None
    ) -> torch.Tensor:
        on_cuda = self.device.type == "cuda"
        x = pixel_values.to(self.device, non_blocking=False) if on_cuda else pixel_values
        if params is None:
            out = x.to(self.dtype)
        else:
            out = self._module(params)(x, self.dtype, layout=params.layout)
        if on_cuda:
            # Waiting here, in a worker thread, keeps the event loop free.
            torch.cuda.current_stream(self.device).synchronize()
        return out
