"""Torch's intra-op pool while an engine is open: the host's setting unless ``torch_threads``
asks for another (``aiomm.tuning.tuned`` asks for one thread when the transform threads already
run in parallel), and the setting restored when the last engine closes."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiomm.adapters import build_processor
from aiomm.config import EngineConfig
from aiomm.engine import Engine


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("transform_threads", "torch_threads", "while_open"),
    [(2, None, 2), (1, None, 2), (2, 2, 2), (1, 1, 1), (2, 1, 1)],
)
def test_torch_threads_while_open(
    two_torch_threads: None, transform_threads: int, torch_threads: int | None, while_open: int
) -> None:
    config = EngineConfig(
        device="cpu", transform_threads=transform_threads, torch_threads=torch_threads
    )
    seen = []

    async def main() -> None:
        async with Engine(build_processor("qwen2-vl"), config):
            seen.append(torch.get_num_threads())

    anyio.run(main)
    assert seen == [while_open]
    assert torch.get_num_threads() == 2
