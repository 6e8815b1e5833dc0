"""``ServingServer``: the process settles for serving once the app has started."""

from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

uvicorn = pytest.importorskip("uvicorn")
sniffio = pytest.importorskip("sniffio")

from aiomm.server.runtime.settle import ServingServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port  # noqa: E402


def test_the_loop_thread_is_declared_and_the_heap_frozen_after_start_up() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                # during start-up: nothing settled yet
                seen["at_start"] = (sniffio.thread_local.name, gc.get_freeze_count())
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        body = orjson.dumps(
            {
                "thread": threading.get_ident(),
                "declared": sniffio.thread_local.name,
                "library": sniffio.current_async_library(),
                "frozen": gc.get_freeze_count(),
            }
        )
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    gc.unfreeze()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)

    class Recorder(ServingServer):
        def serving(self) -> None:  # announced before the process settles
            seen["serving"] = (self.started, sniffio.thread_local.name, gc.get_freeze_count())

    server = Recorder(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        answer = orjson.loads(httpx.get(f"http://127.0.0.1:{port}/", timeout=30).content)
    finally:
        server.should_exit = True
        thread.join(30)
        gc.unfreeze()  # the test process's heap back as it was
    assert seen["at_start"] == (None, 0)
    assert seen["serving"] == (True, None, 0)
    assert answer["thread"] == thread.ident
    assert answer["declared"] == "asyncio" and answer["library"] == "asyncio"
    assert answer["frozen"] > 1000, "the objects alive at start-up were frozen"
    assert sniffio.thread_local.name is None, "only the loop's thread is declared"
