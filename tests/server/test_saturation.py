"""``aiomm_saturation``: how busy the event loop and the transform threads were between two
scrapes, and how full the request slots are now, for an autoscaler."""

from __future__ import annotations

import base64
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from aiomm.config import EngineConfig
from aiomm.media.samples import encode, photo_like
from aiomm.server import ServerConfig

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer

CASE = json.loads((Path(__file__).parent / "fixtures" / "chat_jpeg.json").read_text())


def _saturation(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    found = re.finditer(r'aiomm_saturation\{resource="(\w+)"\} (\S+)', text)
    return {m[1]: float(m[2]) for m in found}


def _body(seed: int) -> dict[str, Any]:
    image = encode(photo_like(np.random.default_rng(seed), 720, 960), "JPEG")
    body = json.loads(json.dumps(CASE["body"]))
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    body["messages"][0]["content"][1]["image_url"]["url"] = url
    return body


def test_saturation_follows_the_work(model_folder: Path) -> None:
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        engine=EngineConfig(device="cpu", transform_threads=2, cache_capacity_bytes=0),
    )
    bodies = [_body(seed) for seed in range(24)]
    with LiveServer(config) as server:
        first = _saturation(server.url)
        assert set(first) == {"event_loop", "transform_threads", "requests", "any"}
        assert all(0 <= v <= 1 for v in first.values())
        _saturation(server.url)  # the window starts here

        def post(body: dict[str, Any]) -> int:
            url = server.url + CASE["path"]
            return httpx.post(url, json=body, timeout=120).status_code

        with ThreadPoolExecutor(4) as pool:
            assert set(pool.map(post, bodies)) == {200}
        busy = _saturation(server.url)
        # the images' decode and resize kept the threads busy for much of the window
        assert busy["transform_threads"] > 0.2, busy
        assert busy["any"] == max(v for k, v in busy.items() if k != "any")
        time.sleep(1.0)
        idle = _saturation(server.url)  # nothing ran since the last scrape
        assert idle["transform_threads"] == 0.0 and idle["requests"] == 0.0, idle
        assert idle["event_loop"] < 0.5, idle
