"""The adapter registry: architecture names and short names -> processor classes.

An adapter module registers its processor class with :func:`register`, one
:class:`Architecture` row per model architecture the class serves; every public module of
``aiomm.adapters`` is imported on first use, so a new module needs no list entry here. A new
architecture whose preprocessing matches an existing family is one row in that family's
``register`` call, e.g. a model served with Qwen3-VL's processor (in ``adapters/qwen_vl.py``)::

    @register(
        ...,
        Architecture("my-vl", "MyVLForConditionalGeneration", QWEN3, "org/My-VL-7B"),
    )
    class QwenVLProcessor(...): ...

where ``QWEN3`` builds the reference HF processor offline. The parity harness
(``tests/support/adapter_parity.py``) then tests the row against that reference on both HF
backends, with no new test code.

:func:`supported_adapters` lists the adapters by module name, then in registration order within
a module: the same order whatever was imported first.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiomm.adapters._stored import offline_hf_processor
from aiomm.errors import ConfigError, UnknownArchitectureError
from aiomm.processing.processor import BaseMultiModalProcessor, MultiModalConfig

__all__ = (
    "AdapterInfo",
    "Architecture",
    "build_processor",
    "from_pretrained",
    "get_adapter_info",
    "register",
    "supported_adapters",
)

P = TypeVar("P", bound=type[BaseMultiModalProcessor])


@dataclass(frozen=True)
class Architecture:
    """One model architecture a processor class serves: a row of :func:`register`."""

    short_name: str
    architecture: str
    #: builds the reference HF processor offline from documented parameters:
    #: ``build_hf_processor(backend="torchvision" | "pil")``
    build_hf_processor: Callable[..., Any]
    example_models: str = ""
    #: other architecture names that select this row (a real checkpoint's ``architectures``
    #: where it differs from the name vLLM's model class has)
    aliases: tuple[str, ...] = ()


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


def _duplicate(name: str, registered: AdapterInfo, new: AdapterInfo) -> ConfigError:
    def where(info: AdapterInfo) -> str:
        return f"{info.processor_cls.__module__}.{info.processor_cls.__qualname__}"

    return ConfigError(
        f"adapter name {name!r} is registered twice: by {where(registered)} and by {where(new)}"
    )


_BY_NAME: dict[str, AdapterInfo] = {}
#: (module, registration number, info): sorted, the order of :func:`supported_adapters`
_ENTRIES: list[tuple[str, int, AdapterInfo]] = []
_COUNTER = itertools.count()


def register(*rows: Architecture) -> Callable[[P], P]:
    """Class decorator: register the processor class under each row's short and architecture
    names.

    :raises ConfigError: if a name is taken (then none of the rows is registered).
    """

    def decorate(cls: P) -> P:
        infos = [
            AdapterInfo(
                short_name=row.short_name,
                architecture=row.architecture,
                processor_cls=cls,
                build_hf_processor=row.build_hf_processor,
                example_models=row.example_models,
            )
            for row in rows
        ]
        taken: dict[str, AdapterInfo] = {}
        for row, info in zip(rows, infos, strict=True):
            for key in (info.short_name, info.architecture, *row.aliases):
                if key in _BY_NAME or key in taken:
                    raise _duplicate(key, _BY_NAME.get(key) or taken[key], info)
                taken[key] = info
        _BY_NAME.update(taken)
        _ENTRIES.extend((cls.__module__, next(_COUNTER), info) for info in infos)
        _ENTRIES.sort(key=lambda entry: entry[:2])
        return cls

    return decorate


def supported_adapters() -> list[AdapterInfo]:
    """Every registered adapter: by module name, then in registration order."""
    _load_builtin()
    return [info for _, _, info in _ENTRIES]


def get_adapter_info(name: str) -> AdapterInfo:
    """Look an adapter up by architecture name or short name.

    :raises UnknownArchitectureError: listing the supported names.
    """
    _load_builtin()
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownArchitectureError(name, (e[2].architecture for e in _ENTRIES)) from None


def build_processor(
    name: str,
    hf_processor: Any | None = None,
    *,
    config: MultiModalConfig | None = None,
    backend: str = "torchvision",
) -> BaseMultiModalProcessor:
    """Build an adapter's processor from an HF processor given in code.

    Without ``hf_processor``, the reference processor is built offline from the architecture's
    documented parameters (with a tokenizer built in code), using ``backend``'s image processor;
    where a snapshot of it is stored (``adapters/_stored.py``), it is built only when a path
    needs more than the snapshot holds (or once, where the installed transformers differs from
    the snapshot's, whose snapshot is then kept in the user's cache folder).

    :raises UnknownArchitectureError: if no adapter has that name.
    """
    info = get_adapter_info(name)
    if hf_processor is None:
        build = functools.partial(info.build_hf_processor, backend=backend)
        hf_processor = offline_hf_processor(f"{info.short_name}/{backend}", build)
        if hf_processor is None:
            hf_processor = build()
    return info.processor_cls(hf_processor, config=config)


def from_pretrained(
    path: str | Path,
    *,
    architecture: str | None = None,
    config: MultiModalConfig | None = None,
    backend: str | None = None,
    **processor_kwargs: Any,
) -> BaseMultiModalProcessor:
    """Build a processor from a local model folder (the adapter's ``load_hf_processor``:
    ``AutoProcessor.from_pretrained`` unless the model has no transformers processor).

    The architecture comes from ``config.json``'s ``architectures`` unless given. ``backend``
    (``"torchvision"`` or ``"pil"``) picks the image processor's backend; None takes
    transformers' default.

    :raises UnknownArchitectureError: if the architecture has no adapter.
    :raises FileNotFoundError: if neither ``architecture`` nor ``config.json`` says which.
    """
    from transformers import AutoImageProcessor

    path = Path(path)
    if architecture is None:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{config_file} not found; pass architecture= to choose the adapter"
            )
        architecture = json.loads(config_file.read_text())["architectures"][0]
    info = get_adapter_info(architecture)
    hf_processor = info.processor_cls.load_hf_processor(str(path), **processor_kwargs)
    if backend is not None and hasattr(hf_processor, "image_processor"):
        # Only the image processor has both backends (video processors are torchvision-only).
        hf_processor.image_processor = AutoImageProcessor.from_pretrained(
            str(path), local_files_only=True, backend=backend
        )
    return info.processor_cls(hf_processor, config=config)


_loaded = False


def _load_builtin() -> None:
    """Import every public module of ``aiomm.adapters`` (each registers its adapters)."""
    global _loaded
    if _loaded:
        return
    package = importlib.import_module(__package__ or "aiomm.adapters")
    for module in pkgutil.iter_modules(package.__path__):
        # Private modules are helpers; registry, offline and folders register nothing
        # (importing them would be harmless, skipping them keeps the intent plain).
        if module.name.startswith("_") or module.name in ("registry", "offline", "folders"):
            continue
        importlib.import_module(f"{package.__name__}.{module.name}")
    _loaded = True
