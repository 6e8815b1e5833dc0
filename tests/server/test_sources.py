"""Image sources other than data: URLs give vLLM's hashes too, data URLs keep to the fetch size
limit; multi-worker config travels."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from starlette.testclient import TestClient

from aiomm.config import EngineConfig, FetchConfig
from aiomm.server import ServerConfig, create_app
from aiomm.server.render import RenderLimits
from aiomm.server.serve import _from_env, _to_env

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer

CASE = json.loads((Path(__file__).parent / "fixtures" / "chat_jpeg.json").read_text())
URL = CASE["body"]["messages"][0]["content"][1]["image_url"]["url"]
JPEG = base64.b64decode(URL.split(",", 1)[1])


def _body(url: str) -> dict[str, Any]:
    body = json.loads(json.dumps(CASE["body"]))
    body["messages"][0]["content"][1]["image_url"]["url"] = url
    return body


def _recorded(model_folder: Path, fetch: FetchConfig) -> ServerConfig:
    """The server of the recorded fixtures' model, with ``fetch`` as its URL policy."""
    return ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        engine=EngineConfig(device="cpu", fetch=fetch),
    )


def test_file_url_under_the_allowed_root(live_server: Any) -> None:
    path = live_server.media / "photo.jpg"
    path.write_bytes(JPEG)
    r = httpx.post(live_server.url + CASE["path"], json=_body(path.as_uri()), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["features"] == CASE["response"]["features"]


def test_http_url_when_the_policy_allows_it(model_folder: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "image/jpeg")
            self.send_header("content-length", str(len(JPEG)))
            self.end_headers()
            self.wfile.write(JPEG)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    config = _recorded(model_folder, FetchConfig(allow_loopback=True))
    try:
        with LiveServer(config) as server:
            url = f"http://127.0.0.1:{httpd.server_address[1]}/photo.jpg"
            r = httpx.post(server.url + CASE["path"], json=_body(url), timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["features"] == CASE["response"]["features"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_worker_config_round_trips() -> None:
    config = ServerConfig(
        model="/m",
        model_id="/id",
        served_model_names=("a", "b"),
        upstream="http://127.0.0.1:1",
        limits=RenderLimits(max_images=3),
        busy_transform_threads=2,
    )
    assert _from_env(_to_env(config)) == config


def test_client_disconnect_cancels_the_render(model_folder: Path) -> None:
    release = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            release.wait(20)
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(JPEG)
            except OSError:
                pass

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    config = _recorded(model_folder, FetchConfig(allow_loopback=True))
    try:
        with LiveServer(config) as server:
            url = f"http://127.0.0.1:{httpd.server_address[1]}/slow.jpg"
            try:
                httpx.post(server.url + CASE["path"], json=_body(url), timeout=0.5)
                raise AssertionError("the slow image should not have arrived")
            except httpx.ReadTimeout:
                pass  # the client gives up and closes its connection
            deadline = time.monotonic() + 10
            text = ""
            while time.monotonic() < deadline:
                text = httpx.get(server.url + "/metrics").text
                if 'endpoint="chat_render",status="499"' in text:
                    break
                time.sleep(0.1)
            # the render ended while the image was still being fetched: its work was cancelled
            assert 'endpoint="chat_render",status="499"' in text
            assert not release.is_set()
            r = httpx.post(server.url + CASE["path"], json=CASE["body"], timeout=60)
            assert r.status_code == 200
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


def test_data_url_above_the_fetch_limit_is_refused_and_one_at_it_renders(
    model_folder: Path,
) -> None:
    def served(limit: int) -> httpx.Response:
        app = create_app(_recorded(model_folder, FetchConfig(max_bytes=limit)))
        with TestClient(app) as client:
            return client.post(CASE["path"], json=CASE["body"])

    refused = served(len(JPEG) - 100)
    assert 400 <= refused.status_code < 500, refused.text
    message = refused.json()["error"]["message"]
    assert "DownloadTooLargeError" in message and "data URL" in message
    assert f"above the limit of {len(JPEG) - 100} bytes" in message
    ok = served(len(JPEG))
    assert ok.status_code == 200, ok.text
    assert ok.json()["features"] == CASE["response"]["features"]
