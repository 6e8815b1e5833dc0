"""Credentials in a URL (user info, a lone token as user name, a signed query) never appear in an
error, its traceback, a log line, a response body or a metric: every source kind and every
fetch error, through the engine and through ``aiomm serve``."""

from __future__ import annotations

import io
import logging
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from hostile_server import HostileServer, drip, fixed

from aiomm import Engine, EngineConfig, Request
from aiomm.config import FetchConfig
from aiomm.errors import (
    AiommError,
    BlockedAddressError,
    DecodeError,
    DownloadTooLargeError,
    FetchError,
    FetchTimeoutError,
    HTTPStatusError,
    InvalidSourceError,
    TooManyRedirectsError,
)
from aiomm.logging import configure_logging
from aiomm.redaction import redact
from aiomm.server import ServerConfig

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer

SECRET = "s3cr3t-Pa55"
PROMPT = "<|vision_start|><|image_pad|><|vision_end|> describe"


def _routes(port_holder: list[int]) -> dict[str, object]:
    def to(path: str) -> object:
        return fixed(302, b"", Location=f"http://user:{SECRET}@127.0.0.1:{port_holder[0]}{path}")

    return {
        "/404": fixed(404, b"gone"),
        "/garbage.png": fixed(200, b"this is not an image at all", Content_Type="image/png"),
        "/big.png": fixed(200, b"\x89PNG" + bytes(300_000)),
        "/slow.png": drip,
        "/to-404-with-creds": to("/404"),
        "/to-private-with-creds": fixed(302, b"", Location=f"http://user:{SECRET}@10.0.0.1/x.png"),
        "/to-malformed-with-creds": fixed(302, b"", Location=f"http://user:{SECRET}@[::1"),
        "/loop": to("/loop"),
    }


@pytest.fixture(scope="module")
def server() -> Iterator[HostileServer]:
    port: list[int] = []
    hostile = HostileServer({})
    port.append(hostile.port)
    hostile.routes = _routes(port)  # type: ignore[assignment]
    with hostile.running() as running:
        yield running


def _cases(port: int) -> list[tuple[str, type[AiommError], bool]]:
    """(source, the error it gets, whether loopback is allowed for it)."""
    base = f"127.0.0.1:{port}"
    return [
        (f"http://user:{SECRET}@[::1", InvalidSourceError, True),
        (f"https://user:{SECRET}@[::1]:99999/x.png", InvalidSourceError, True),
        (f"http://user:{SECRET}@exa mple.com/x.png", InvalidSourceError, True),
        (f"ftp://user:{SECRET}@example.com/x.png", InvalidSourceError, True),
        (f"file://user:{SECRET}@example.com/x.png", FetchError, True),
        (f"http://{SECRET}@{base}/404", HTTPStatusError, True),
        (f"http://user:{SECRET}@{base}/404", HTTPStatusError, True),
        (f"http://{base}/404?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}", HTTPStatusError,
         True),
        (f"http://user:{SECRET}@{base}/to-404-with-creds", HTTPStatusError, True),
        (f"http://{base}/to-404-with-creds", HTTPStatusError, True),
        (f"http://{base}/to-private-with-creds", BlockedAddressError, True),
        (f"http://{base}/to-malformed-with-creds", FetchError, True),
        (f"http://user:{SECRET}@{base}/loop", TooManyRedirectsError, True),
        (f"http://user:{SECRET}@{base}/slow.png", FetchTimeoutError, True),
        (f"http://user:{SECRET}@{base}/big.png", DownloadTooLargeError, True),
        (f"http://user:{SECRET}@{base}/garbage.png", DecodeError, True),
        (f"http://user:{SECRET}@127.0.0.1:1/x.png", FetchError, True),  # connection refused
        (f"http://user:{SECRET}@{base}/404", BlockedAddressError, False),
        (f"http://user:{SECRET}@localhost:{port}/404", BlockedAddressError, False),
        (f"HTTP://USER:{SECRET}@[::1]:{port}/404", BlockedAddressError, False),
    ]  # fmt: skip


def _fetch_config(loopback: bool) -> FetchConfig:
    return FetchConfig(
        allow_loopback=loopback,
        max_bytes=100_000,
        connect_timeout=2.0,
        read_timeout=0.5,
        total_timeout=1.5,
        max_redirects=3,
    )


def _everything_shown(error: BaseException) -> str:
    """What a host could show of an error: its text, repr, fields and whole traceback chain."""
    fields = " ".join(str(v) for v in vars(error).values())
    return " ".join([str(error), repr(error), fields, "".join(traceback.format_exception(error))])


def test_redact_masks_every_spelling() -> None:
    for text, shown in [
        (f"http://user:{SECRET}@[::1", "http://user:***@[::1"),
        (f"https://{SECRET}@h/a.png", "https://***@h/a.png"),
        (f"https://u:p@{SECRET}@h/a", "https://u:***@h/a"),
        (f"https://h/a.png?sig={SECRET}&w=1", "https://h/a.png?sig=***&w=1"),
        (f"(source: 'redis://:{SECRET}@localhost:6379/0')", "(source: 'redis://:***@localhost:6379/0')"),
        ("https://medium.com/@user/post", "https://medium.com/@user/post"),
    ]:  # fmt: skip
        assert redact(text) == shown
        assert redact(shown) == shown
    assert redact(f"(source: http://h/a?token={SECRET})") == "(source: http://h/a?token=***)"
    # a parser's message quoting a piece of the URL outside any URL
    assert SECRET not in redact(f"Invalid port: '{SECRET}@x'", source=f"http://u:{SECRET}@x")


async def test_no_error_or_log_line_of_the_engine_shows_the_secret(server: HostileServer) -> None:
    log = io.StringIO()
    configure_logging(level="DEBUG", stream=log, json=True)
    try:
        for loopback in (True, False):
            cases = [c for c in _cases(server.port) if c[2] is loopback]
            config = EngineConfig(device="cpu", fetch=_fetch_config(loopback))
            async with Engine.from_pretrained("qwen2-vl", config) as engine:
                for source, error, _ in cases:
                    result = await engine.process_safe(
                        Request(prompt=PROMPT, images=[np.zeros((8, 8, 3), np.uint8), source])
                    )
                    assert isinstance(result.error, error), (source, result.error)
                    assert result.error.item_index == 1
                    shown = _everything_shown(result.error)
                    assert SECRET not in shown, (source, shown)
                    # the masked source still says which item it was
                    if isinstance(result.error, FetchError) and "user:" in source:
                        assert "user:***@" in str(result.error), str(result.error)
    finally:
        root = logging.getLogger("aiomm")
        for handler in list(root.handlers):
            if isinstance(handler, logging.StreamHandler) and handler.stream is log:
                root.removeHandler(handler)
    assert "fetch" in log.getvalue()  # the events were logged, and masked
    assert SECRET not in log.getvalue()


@pytest.fixture(scope="module")
def render_server(model_folder: Path, server: HostileServer) -> Iterator[LiveServer]:
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        engine=EngineConfig(device="cpu", torch_threads=1, fetch=_fetch_config(True)),
    )
    with LiveServer(config) as live:
        yield live


def test_no_response_log_or_metric_of_the_server_shows_the_secret(
    render_server: LiveServer, server: HostileServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = render_server.url
    caplog.set_level(logging.DEBUG, logger="aiomm")
    cases = [c for c in _cases(server.port) if c[2]]
    with httpx.Client(base_url=url, timeout=60) as client:
        for source, _, _ in cases:
            body = {
                "model": RECORDED_MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is it?"},
                            {"type": "image_url", "image_url": {"url": source}},
                        ],
                    }
                ],
            }
            response = client.post("/v1/chat/completions/render", json=body)
            assert 400 <= response.status_code < 500, (source, response.text)
            assert SECRET not in response.text, (source, response.text)
            assert response.json()["error"]["message"]
        metrics = client.get("/metrics").text
    assert SECRET not in metrics
    assert "status=400" in caplog.text  # the server's log lines were captured
    assert SECRET not in caplog.text
