"""aiomm: an async streaming preprocessing engine for multimodal model serving.

``import aiomm`` stays light: the engine, and with it torch and transformers, load on first use
of a name that needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .logging import configure_logging as configure_logging

if TYPE_CHECKING:
    from .config import EngineConfig as EngineConfig
    from .decode import DecodeConfig as DecodeConfig
    from .engine import Engine as Engine
    from .engine import EngineStats as EngineStats
    from .fetch import FetchConfig as FetchConfig
    from .item_cache import CacheOutcome as CacheOutcome
    from .processing.processor import MultiModalConfig as MultiModalConfig
    from .types import Request as Request
    from .types import Result as Result

__version__ = "0.1.0"

_LAZY = {
    "CacheOutcome": "aiomm.item_cache",
    "DecodeConfig": "aiomm.decode",
    "Engine": "aiomm.engine",
    "EngineConfig": "aiomm.config",
    "EngineStats": "aiomm.engine",
    "FetchConfig": "aiomm.fetch",
    "MultiModalConfig": "aiomm.processing.processor",
    "Request": "aiomm.types",
    "Result": "aiomm.types",
}

__all__ = (
    "CacheOutcome",
    "DecodeConfig",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FetchConfig",
    "MultiModalConfig",
    "Request",
    "Result",
    "__version__",
    "configure_logging",
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
