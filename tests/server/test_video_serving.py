"""``video_url`` parts at the render endpoint: limits and bad videos are typed 4xx answers that
leave the server serving, and a repeated video is rendered the same (from the engine's cache)."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

av = pytest.importorskip("av")

from aiomm.server import ServerConfig  # noqa: E402
from aiomm.server.render import RenderLimits  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer  # noqa: E402
from record_fixtures import data_url, videos  # noqa: E402

RENDER = "/v1/chat/completions/render"


@pytest.fixture(scope="module")
def server(model_folder: Path) -> Iterator[LiveServer]:
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        limits=RenderLimits(max_videos=2, max_video_bytes=10_000),
    )
    with LiveServer(config) as live:
        yield live


@pytest.fixture(scope="module")
def clips() -> dict[str, tuple[str, bytes]]:
    return videos()


def _body(*urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe."}]
    parts += [{"type": "video_url", "video_url": {"url": u}} for u in urls]
    return {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": parts}]}


def _post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + RENDER, json=body, timeout=60)


def _truncated_mp4(path: Path) -> bytes:
    """The first half of an MP4 whose header (``moov`` first) announces all 24 frames. vLLM
    renders the frames it can read; aiomm refuses the video (a documented difference)."""
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(24):
            frame = av.VideoFrame.from_ndarray(
                np.full((48, 64, 3), 10 * i, dtype=np.uint8), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = path.read_bytes()
    return data[: len(data) // 2]


def _zero_frames() -> bytes:
    """An AVI with a video stream and no frame."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height = 32, 32
        container.start_encoding()
    return buf.getvalue()


def test_bad_videos_are_400s_and_the_server_keeps_serving(
    server: LiveServer, clips: dict[str, tuple[str, bytes]], tmp_path: Path
) -> None:
    good = data_url(clips["vp9"])
    cases = {
        "too many videos": _body(good, good, good),
        "above the limit of 10000 bytes": _body(data_url(clips["noise"])),  # 18852 bytes
        "DecodeError: not a decodable video": _body(data_url(("video/mp4", b"\0" * 64))),
        "DecodeError: truncated video": _body(
            data_url(("video/mp4", _truncated_mp4(tmp_path / "cut.mp4")))
        ),
        "EmptyVideoError": _body(data_url(("video/x-msvideo", _zero_frames()))),
        "malformed base64": _body("data:video/mp4;base64,@@@@"),
        "media_io_kwargs is not supported": {
            **_body(good),
            "media_io_kwargs": {"video": {"fps": 1}},
        },
    }
    first = _post(server, _body(good))
    assert first.status_code == 200, first.text
    for needle, body in cases.items():
        resp = _post(server, body)
        assert resp.status_code == 400, (needle, resp.text)
        error = resp.json()["error"]
        assert needle in error["message"], (needle, error)
        assert error["type"] == "BadRequestError"
        again = _post(server, _body(good))
        assert again.status_code == 200
        assert again.json()["features"] == first.json()["features"]


def test_video_parts_only_in_chat(server: LiveServer, clips: dict[str, tuple[str, bytes]]) -> None:
    body = {
        "model": RECORDED_MODEL,
        "input": [
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": data_url(clips["vp9"])}}],
            }
        ],
    }
    resp = httpx.post(server.url + "/v1/responses/render", json=body, timeout=60)
    assert resp.status_code == 400  # as vLLM 0.33: Responses has no video part
    missing = {"type": "video_url", "video_url": {}}
    resp = _post(server, {"messages": [{"role": "user", "content": [missing]}]})
    assert resp.status_code == 400 and "video_url.url is missing" in resp.text
