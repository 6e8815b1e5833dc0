"""``mm_payload: "none"`` is answered with the engine's routing plan: equal to the tensors
render without its payload, counted in ``aiomm_plans_total`` by how each item was planned, and a
bad item refused as the tensors render refuses it."""

from __future__ import annotations

import base64
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import PIL.Image

from aiomm.media.samples import photo_like

sys.path.insert(0, str(Path(__file__).parent))

CASE = json.loads((Path(__file__).parent / "fixtures" / "chat_jpeg.json").read_text())


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _image(fmt: str, width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    photo_like(np.random.default_rng(seed), height, width).save(buf, fmt)
    return buf.getvalue()


def _body(urls: list[str], payload: str) -> dict[str, Any]:
    body = json.loads(json.dumps(CASE["body"]))
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body["messages"][0]["content"] = [{"type": "text", "text": "Compare."}, *parts]
    body["mm_payload"] = payload
    return body


def _plans(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        m[1]: float(m[2]) for m in re.finditer(r'aiomm_plans_total\{source="(\w+)"\} (\S+)', text)
    }


def test_none_equals_tensors_without_the_payload(live_server: Any) -> None:
    url = live_server.url + CASE["path"]
    images = [
        _data_url(_image("JPEG", 200 + 37 * k, 120 + 11 * k, k), "image/jpeg") for k in range(3)
    ] + [_data_url(_image("GIF", 90, 64, 9), "image/gif")]
    before = _plans(live_server.url)
    planned = httpx.post(url, json=_body(images, "none"), timeout=60)
    assert planned.status_code == 200, planned.text
    after = _plans(live_server.url)
    # three JPEGs read from their headers, the GIF decoded to know its size
    assert after["header"] - before["header"] == 3
    assert after["decoded"] - before["decoded"] == 1
    full = httpx.post(url, json=_body(images, "tensors"), timeout=60)
    assert full.status_code == 200, full.text
    want, got = full.json(), planned.json()
    for key in ("token_ids", "sampling_params", "model"):
        assert got[key] == want[key]
    assert got["features"]["mm_hashes"] == want["features"]["mm_hashes"]
    assert got["features"]["mm_placeholders"] == want["features"]["mm_placeholders"]
    assert got["features"]["kwargs_data"] is None and got["features"]["mm_metadata"] is None
    # the tensors render cached the items: the same plan is now answered from the cache
    again = httpx.post(url, json=_body(images, "none"), timeout=60)
    assert again.json()["features"] == got["features"]
    assert _plans(live_server.url)["cached"] - after["cached"] == 4


def test_a_truncated_image_is_refused_alike(live_server: Any) -> None:
    url = live_server.url + CASE["path"]
    cut = _image("JPEG", 300, 200, 4)[:-400]
    answers = [
        httpx.post(url, json=_body([_data_url(cut, "image/jpeg")], p), timeout=60)
        for p in ("none", "tensors")
    ]
    assert [a.status_code for a in answers] == [400, 400]
    errors = [a.json()["error"] for a in answers]
    for error in errors:  # each request's own id
        error["message"] = re.sub(r"request_id='\w+'", "", error["message"])
    assert errors[0] == errors[1]
    assert "truncated" in errors[0]["message"]


def test_a_truncated_png_is_planned_by_decoding(live_server: Any) -> None:
    url = live_server.url + CASE["path"]
    image = PIL.Image.fromarray(np.full((40, 50, 3), 7, np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    no_iend = buf.getvalue()[:-12]  # the decode takes it (Pillow's own rule), so the plan does
    answers = [
        httpx.post(url, json=_body([_data_url(no_iend, "image/png")], p), timeout=60)
        for p in ("none", "tensors")
    ]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["token_ids"] == answers[1].json()["token_ids"]
