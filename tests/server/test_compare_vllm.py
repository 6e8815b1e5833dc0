"""The randomized comparison tool (``compare_vllm.py``) itself: two servers that render alike
compare equal on its random requests, and a difference it must see (another model id, so other
mm_hashes) is found in every request with an image."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from compare_vllm import compare
from conftest import RECORDED_MODEL, LiveServer
from random_requests import random_requests

from aiomm.server import ServerConfig


@pytest.fixture(scope="module")
def twin(model_folder: Path) -> Iterator[LiveServer]:
    config = ServerConfig(
        model=str(model_folder), model_id=RECORDED_MODEL, served_model_names=(RECORDED_MODEL,)
    )
    with LiveServer(config) as server:
        yield server


@pytest.fixture(scope="module")
def other_model_id(model_folder: Path) -> Iterator[LiveServer]:
    config = ServerConfig(
        model=str(model_folder), model_id="/elsewhere", served_model_names=(RECORDED_MODEL,)
    )
    with LiveServer(config) as server:
        yield server


def _requests(n: int) -> list[tuple[str, dict[str, Any], list[str]]]:
    return list(itertools.islice(random_requests(7, RECORDED_MODEL), n))


def test_the_random_requests_cover_the_apis_and_formats() -> None:
    requests = _requests(40)
    assert {path for path, _, _ in requests} >= {
        "/v1/chat/completions/render",
        "/v1/responses/render",
        "/v1/messages/render",
    }
    formats = {what.split("/")[0] for _, _, media in requests for what in media}
    assert formats >= {"jpeg", "png", "webp"}


async def test_servers_that_render_alike_compare_equal(
    live_server: LiveServer, twin: LiveServer
) -> None:
    report = await compare(live_server.url, twin.url, _requests(12))
    assert len(report.cases) == 12
    assert not report.differing, [c.found for c in report.differing]
    assert sum(n for (a, _), n in report.statuses().items() if a == 200) >= 8


async def test_a_different_render_is_found(
    live_server: LiveServer, other_model_id: LiveServer
) -> None:
    report = await compare(live_server.url, other_model_id.url, _requests(6))
    for case in report.cases:
        if case.theirs[0] == 200:
            assert any("mm_hashes" in line for line in case.found), case.found
    assert report.differing
