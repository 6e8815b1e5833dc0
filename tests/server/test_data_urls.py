"""Data-URL payloads decoded from a body's bytes (``aiomm.server.data_urls``): the parts get the
bytes their URLs hold, anything else stays in the body, and the server answers as it does for the
body parsed whole."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from aiomm.server.data_urls import LIFT_MIN_CHARS, attach, lift_data_urls
from aiomm.vllm.content import parse_chat

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL

CASE = json.loads((Path(__file__).parent / "fixtures" / "chat_jpeg.json").read_text())
DATA = os.urandom(9000)
B64 = base64.b64encode(DATA).decode()


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(*parts: dict[str, Any]) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": list(parts)}]}).encode()


def test_large_base64_payloads_are_decoded_and_the_rest_stays_in_the_body() -> None:
    small = base64.b64encode(b"x" * 30).decode()
    stays = [
        "data:image/png;base64," + small,  # too small to be worth it
        "data:image/png," + B64,  # not base64
        "data:image/png;base64," + B64[:-8] + "!!!!!!!!",  # not strict base64: the usual error
    ]
    raw = _chat(
        _image("data:image/png;base64," + B64),
        {"type": "text", "text": "two of them"},
        *[_image(url) for url in stays],
        _image("data:image/jpeg;BASE64," + B64),
    )
    lifted_raw, lifted = lift_data_urls(raw, max_bytes=1 << 20)
    assert lifted is not None and lifted.raw is raw
    assert list(lifted.payloads) == [DATA, DATA]
    assert len(lifted_raw) < len(raw) - 2 * len(B64) + 200
    parsed = attach(parse_chat(orjson.loads(lifted_raw)), lifted)
    assert parsed is not None
    whole = parse_chat(orjson.loads(raw))
    assert parsed.conversation == whole.conversation
    assert [p.data for p in parsed.images] == [DATA, None, None, None, DATA]
    assert [p.url for p in parsed.images][1:4] == stays
    assert parsed.images[0].url.startswith("data:image/png;base64,#aiomm-")


def test_payloads_with_escapes_above_the_limit_or_none_leave_the_body_as_it_is() -> None:
    escaped = _chat(_image("data:image/png;base64," + B64)).replace(b"/", b"\\/")
    assert lift_data_urls(escaped, 1 << 20) == (escaped, None)
    # a data URL quoted inside another string is part of that string
    quoted = _chat(_image('"data:image/png;base64,' + B64))
    assert b'\\"data:' in quoted and lift_data_urls(quoted, 1 << 20) == (quoted, None)
    gathered = bytearray(_chat(_image("data:image/png;base64," + B64)))  # a body read in pieces
    _, lifted = lift_data_urls(gathered, 1 << 20)
    assert lifted is not None and lifted.raw is gathered and list(lifted.payloads) == [DATA]
    raw = _chat(_image("data:image/png;base64," + B64))
    assert lift_data_urls(raw, len(DATA) - 10) == (raw, None)  # the usual size error follows
    assert lift_data_urls(raw, len(DATA))[1] is not None
    plain = _chat({"type": "text", "text": "hello"})
    assert lift_data_urls(plain, 1 << 20) == (plain, None)
    assert len(B64) >= LIFT_MIN_CHARS


def test_a_payload_that_is_not_a_media_url_sends_the_body_back_to_be_parsed_whole() -> None:
    for raw in (
        _chat({"type": "text", "text": "data:text/plain;base64," + B64}, _image("data:,")),
        _chat({"type": "text", "text": "hi"})[:-1]
        + b', "note": "data:a;base64,%s"}' % B64.encode(),
    ):
        lifted_raw, lifted = lift_data_urls(raw, 1 << 20)
        assert lifted is not None
        assert attach(parse_chat(orjson.loads(lifted_raw)), lifted) is None
    # a reference counts only as a data URL's payload
    raw = _chat(_image("data:image/png;base64," + B64))
    lifted_raw, lifted = lift_data_urls(raw, 1 << 20)
    assert lifted is not None
    elsewhere = lifted_raw.replace(b"data:image/png;base64,", b"https://h/a,")
    assert attach(parse_chat(orjson.loads(elsewhere)), lifted) is None


def _post(server: Any, raw: bytes) -> httpx.Response:
    return httpx.post(
        server.url + CASE["path"],
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def test_the_server_answers_as_for_the_body_parsed_whole(live_server: Any) -> None:
    raw = json.dumps(CASE["body"]).encode()
    assert lift_data_urls(raw, 1 << 30)[1] is not None  # the recorded image is taken out
    r = _post(live_server, raw)
    assert r.status_code == 200, r.text
    assert r.json()["features"] == CASE["response"]["features"]
    assert r.json()["token_ids"] == CASE["response"]["token_ids"]
    # escaped slashes: parsed by orjson, the same image
    r = _post(live_server, raw.replace(b"/", b"\\/"))
    assert r.status_code == 200, r.text
    assert r.json()["features"] == CASE["response"]["features"]


def test_a_text_that_is_a_data_url_is_rendered_as_sent(live_server: Any) -> None:
    body = json.loads(json.dumps(CASE["body"]))
    text = "data:text/plain;base64," + B64
    body["messages"][0]["content"].append({"type": "text", "text": text})
    raw = json.dumps(body).encode()
    r = _post(live_server, raw)
    assert r.status_code == 200, r.text
    tokenized = httpx.post(live_server.url + "/tokenize", json=body, timeout=60)  # never lifted
    assert tokenized.status_code == 200, tokenized.text
    assert r.json()["token_ids"] == tokenized.json()["tokens"]
    assert r.json()["features"]["mm_hashes"] == CASE["response"]["features"]["mm_hashes"]


def test_a_field_that_is_a_data_url_reaches_the_response_as_sent(live_server: Any) -> None:
    body = json.loads(json.dumps(CASE["body"]))
    note = "data:text/plain;base64," + B64
    body["chat_template_kwargs"] = {"note": note}
    r = _post(live_server, json.dumps(body).encode())
    assert r.status_code == 200, r.text
    assert r.json()["features"] == CASE["response"]["features"]
    assert r.json()["parse_context"]["chat_template_kwargs"]["note"] == note


def test_bad_payloads_get_the_errors_of_the_body_parsed_whole(live_server: Any) -> None:
    url = CASE["body"]["messages"][0]["content"][1]["image_url"]["url"]
    raw = json.dumps(CASE["body"]).encode()
    payload = url.split(",", 1)[1].encode()
    cut = len(payload) // 2
    control = raw.replace(payload, payload[:cut] + b"\x01" + payload[cut + 1 :])
    r = _post(live_server, control)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"], r.text
    bad = raw.replace(payload, payload[:cut] + b"!" + payload[cut + 1 :])
    r = _post(live_server, bad)
    assert r.status_code == 400 and "malformed base64" in r.json()["error"]["message"], r.text
    trailing = (
        raw[:-1] + b",}"
    )  # malformed JSON after the payload: its error names the body's own position
    r = _post(live_server, trailing)
    try:
        orjson.loads(trailing)
    except orjson.JSONDecodeError as exc:
        expected = str(exc)
    assert r.status_code == 400 and expected in r.json()["error"]["message"], r.text
    r = _post(live_server, raw)  # and the next request is fine
    assert r.status_code == 200 and r.json()["features"] == CASE["response"]["features"]


def test_a_render_after_the_encode_pool_closed_is_a_503(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.testclient import TestClient

    import aiomm.server.render
    from aiomm.engine._worker_pool import WorkerPool
    from aiomm.server import ServerConfig, create_app

    class Closed(WorkerPool):  # the pool of a server that is stopping
        async def run(self, fn: Any, *args: object) -> Any:
            await self.aclose()
            return await super().run(fn, *args)

    monkeypatch.setattr(aiomm.server.render, "WorkerPool", Closed)
    app = create_app(
        ServerConfig(
            model=str(model_folder),
            model_id=RECORDED_MODEL,
            served_model_names=(RECORDED_MODEL,),
        )
    )
    with TestClient(app) as client:
        r = client.post(CASE["path"], json=CASE["body"])
    assert r.status_code == 503, r.text
    assert "worker threads are closed" in r.json()["error"]["message"]
