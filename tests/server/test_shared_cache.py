"""Two ``aiomm serve`` replicas on one Redis (``--shared-cache``): an image one renders is a
shared hit for the other, the response identical, and ``/metrics`` shows the Redis tier."""

from __future__ import annotations

import base64
import io
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


def test_replicas_share_items_through_redis(model_folder: Path, redis_server: RedisServer) -> None:
    def config() -> ServerConfig:
        return ServerConfig(
            model=str(model_folder),
            model_id=RECORDED_MODEL,
            served_model_names=(RECORDED_MODEL,),
            shared_cache_url=redis_server.url,
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
    assert 'aiomm_shared_cache_events_total_engine{event="misses"} 1.0' in first_metrics
    assert 'aiomm_shared_cache_events_total_engine{event="hits"} 1.0' in second_metrics
    assert "aiomm_shared_cache_available 1.0" in second_metrics
