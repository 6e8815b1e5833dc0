"""Fixtures of the reliability suite."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from aiomm.adapters import build_processor, get_adapter_info
from aiomm.processing.processor import MultiModalConfig


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@functools.cache
def _hf_processor(name: str, backend: str) -> Any:
    return get_adapter_info(name).build_hf_processor(backend=backend)


@pytest.fixture
def make_processor():
    def make(name: str = "qwen2-vl", backend: str = "torchvision", **config: Any):
        return build_processor(
            name, _hf_processor(name, backend), config=MultiModalConfig(**config)
        )

    return make
