"""The adapter registry: architecture names and short names -> processor classes."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiomm.errors import UnknownArchitectureError
from aiomm.processing.processor import BaseMultiModalProcessor, MultiModalConfig

__all__ = (
    "AdapterInfo",
    "build_processor",
    "from_pretrained",
    "get_adapter_info",
    "register",
    "supported_adapters",
)


@dataclass(frozen=True)
class AdapterInfo:
    """One supported architecture."""

    short_name: str
    architecture: str
    processor_cls: type[BaseMultiModalProcessor]
    #: builds the reference HF processor offline from documented parameters:
    #: ``build_hf_processor(backend="torchvision" | "pil")``
    build_hf_processor: Callable[..., Any]
    example_models: str = ""

    @property
    def mm_device_do_normalize(self) -> bool:
        """The default of ``mm_device_do_normalize`` for this architecture."""
        return self.processor_cls.default_device_normalize


_BY_NAME: dict[str, AdapterInfo] = {}
_ORDER: list[AdapterInfo] = []


def register(info: AdapterInfo) -> AdapterInfo:
    """Register an adapter under its short name and its architecture name."""
    for key in (info.short_name, info.architecture):
        if key in _BY_NAME:
            raise ValueError(f"adapter name {key!r} is registered twice")
        _BY_NAME[key] = info
    _ORDER.append(info)
    return info


def supported_adapters() -> list[AdapterInfo]:
    """Every registered adapter, in registration order."""
    _load_builtin()
    return list(_ORDER)


def get_adapter_info(name: str) -> AdapterInfo:
    """Look an adapter up by architecture name or short name.

    :raises UnknownArchitectureError: listing the supported names.
    """
    _load_builtin()
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownArchitectureError(name, (i.architecture for i in _ORDER)) from None


def build_processor(
    name: str,
    hf_processor: Any | None = None,
    *,
    config: MultiModalConfig | None = None,
    backend: str = "torchvision",
) -> BaseMultiModalProcessor:
    """Build an adapter's processor from an HF processor given in code.

    Without ``hf_processor``, the reference processor is built offline from the architecture's
    documented parameters (with a tokenizer built in code), using ``backend``'s image processor.
    """
    info = get_adapter_info(name)
    if hf_processor is None:
        hf_processor = info.build_hf_processor(backend=backend)
    return info.processor_cls(hf_processor, config=config)


def from_pretrained(
    path: str | Path,
    *,
    architecture: str | None = None,
    config: MultiModalConfig | None = None,
    backend: str | None = None,
    **processor_kwargs: Any,
) -> BaseMultiModalProcessor:
    """Build a processor from a local model folder (``AutoProcessor.from_pretrained``).

    The architecture comes from ``config.json``'s ``architectures`` unless given. ``backend``
    (``"torchvision"`` or ``"pil"``) picks the image processor's backend; None takes
    transformers' default.

    :raises UnknownArchitectureError: if the architecture has no adapter.
    :raises FileNotFoundError: if neither ``architecture`` nor ``config.json`` says which.
    """
    from transformers import AutoImageProcessor, AutoProcessor

    path = Path(path)
    if architecture is None:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{config_file} not found; pass architecture= to choose the adapter"
            )
        architecture = json.loads(config_file.read_text())["architectures"][0]
    info = get_adapter_info(architecture)
    hf_processor = AutoProcessor.from_pretrained(
        str(path), local_files_only=True, **processor_kwargs
    )
    if backend is not None:
        # Only the image processor has both backends (video processors are torchvision-only).
        hf_processor.image_processor = AutoImageProcessor.from_pretrained(
            str(path), local_files_only=True, backend=backend
        )
    return info.processor_cls(hf_processor, config=config)


_loaded = False


#: adapter modules (``aiomm.adapters.<name>``) that register themselves on import
_BUILTIN_MODULES: tuple[str, ...] = (
    "qwen_vl",
    "intern_s",
    "nemotron_vl",
    "glm",
    "mistral3",
    "chameleon",
)


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(f"aiomm.adapters.{module}")
