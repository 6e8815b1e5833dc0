"""Two ``aiomm serve`` instances sharing items, as replicas on one Redis (``--shared-cache``) or
as the workers of ``--workers N`` (a peer folder): an image one renders is a hit for the other,
the response identical, and ``/metrics`` shows the tier."""

from __future__ import annotations

import base64
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import PIL.Image
import pytest
from redis_server import RedisServer

pytest.importorskip("starlette")
from aiomm.server import ServerConfig

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def _body() -> dict:
    rgb = np.random.default_rng(5).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(rgb).save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi."}]
    return {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("tier", ["redis", "peer"])
def test_two_servers_share_items(
    model_folder: Path, tmp_path: Path, request: pytest.FixtureRequest, tier: str
) -> None:
    """Replicas through Redis, or the workers of ``--workers N`` through their peer folder."""
    where: dict = {"peer_cache_dir": str(tmp_path)}
    if tier == "redis":
        where = {"shared_cache_url": request.getfixturevalue("redis_server").url}

    def config() -> ServerConfig:
        return ServerConfig(
            model=str(model_folder),
            model_id=RECORDED_MODEL,
            served_model_names=(RECORDED_MODEL,),
            **where,
        )

    path = "/v1/chat/completions/render"
    with LiveServer(config()) as first, LiveServer(config()) as second:
        a = httpx.post(first.url + path, json=_body(), timeout=60)
        b = httpx.post(second.url + path, json=_body(), timeout=60)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["features"] == b.json()["features"]
        assert a.json()["token_ids"] == b.json()["token_ids"]
        first_metrics = httpx.get(first.url + "/metrics").text
        second_metrics = httpx.get(second.url + "/metrics").text
    gauge = f"aiomm_{'shared' if tier == 'redis' else 'peer'}_cache_events_total_engine"
    assert gauge + '{event="misses"} 1.0' in first_metrics
    assert gauge + '{event="hits"} 1.0' in second_metrics
    if tier == "redis":
        assert "aiomm_shared_cache_available 1.0" in second_metrics
    else:
        assert gauge + '{event="served"} 1.0' in first_metrics
        assert gauge + '{event="errors"} 0.0' in second_metrics
        assert os.listdir(tmp_path) == []  # both closed: sockets and links removed


async def test_server_config_reaches_the_engine(model_folder: Path, tmp_path: Path) -> None:
    from aiomm.server.app import open_state

    config = ServerConfig(
        model=str(model_folder),
        peer_cache_dir=str(tmp_path),
        transform_threads=1,
        busy_transform_threads=1,
        cache_bytes=96 << 20,
    )
    async with open_state(config) as state:
        engine_cfg = state.engine.config
        sockets = os.listdir(tmp_path)
        capacity = state.engine.stats().cache.capacity_bytes
    assert engine_cfg.peer_cache_dir == str(tmp_path) and engine_cfg.transform_threads == 1
    assert engine_cfg.busy_transform_threads == 1
    assert engine_cfg.cache_capacity_bytes == capacity == 96 << 20
    assert len(sockets) == 1 and sockets[0].endswith(".sock")
