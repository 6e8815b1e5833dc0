"""Two app instances sharing a peer folder (what ``aiomm serve --workers N`` sets up): an image
one renders is copied by the other, the response identical, and ``/metrics`` shows the tier."""

from __future__ import annotations

import base64
import io
import os
import sys
from pathlib import Path

import httpx
import numpy as np
import PIL.Image
import pytest

pytest.importorskip("starlette")
from aiomm.server import ServerConfig

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer


def _body() -> dict:
    rgb = np.random.default_rng(6).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(rgb).save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi."}]
    return {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": content}]}


def test_workers_copy_items_from_each_other(model_folder: Path, tmp_path: Path) -> None:
    def config() -> ServerConfig:
        return ServerConfig(
            model=str(model_folder),
            model_id=RECORDED_MODEL,
            served_model_names=(RECORDED_MODEL,),
            peer_cache_dir=str(tmp_path),
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
    assert 'aiomm_peer_cache_events_total_engine{event="misses"} 1.0' in first_metrics
    assert 'aiomm_peer_cache_events_total_engine{event="served"} 1.0' in first_metrics
    assert 'aiomm_peer_cache_events_total_engine{event="hits"} 1.0' in second_metrics
    assert 'aiomm_peer_cache_events_total_engine{event="errors"} 0.0' in second_metrics
    assert list(tmp_path.iterdir()) == []  # both closed: sockets and links removed


async def test_server_config_reaches_the_engine(model_folder: Path, tmp_path: Path) -> None:
    from aiomm.server.app import open_state

    config = ServerConfig(
        model=str(model_folder), peer_cache_dir=str(tmp_path), transform_threads=1
    )
    async with open_state(config) as state:
        engine_cfg = state.engine.config
        sockets = os.listdir(tmp_path)
    assert engine_cfg.peer_cache_dir == str(tmp_path) and engine_cfg.transform_threads == 1
    assert len(sockets) == 1 and sockets[0].endswith(".sock")
