"""The ASGI app mounted inside another Starlette app, as README's example does."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from aiomm.server import ServerConfig, create_app
from aiomm.server.runtime.protocol import RenderHttpProtocol

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer


class _Mounted(LiveServer):
    def __init__(self, app: Starlette) -> None:
        super().__init__(ServerConfig(model="unused"))
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                http=RenderHttpProtocol,
            )
        )
        import threading

        self.thread = threading.Thread(target=self.server.run, daemon=True)


def test_mounted_render_app(model_folder: Path) -> None:
    render = create_app(
        ServerConfig(
            model=str(model_folder), model_id=RECORDED_MODEL, served_model_names=(RECORDED_MODEL,)
        )
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with render.router.lifespan_context(render):
            yield

    async def own(request: object) -> PlainTextResponse:
        return PlainTextResponse("gateway")

    parent = Starlette(
        routes=[Route("/health", own), Mount("/render", app=render)], lifespan=lifespan
    )
    case = json.loads((Path(__file__).parent / "fixtures" / "chat_jpeg.json").read_text())
    with _Mounted(parent) as server:
        r = httpx.post(server.url + "/render" + case["path"], json=case["body"], timeout=60)
        assert r.status_code == 200
        assert r.json()["token_ids"] == case["response"]["token_ids"]
        assert r.json()["features"]["mm_hashes"] == case["response"]["features"]["mm_hashes"]
        assert httpx.get(server.url + "/render/health").status_code == 200
