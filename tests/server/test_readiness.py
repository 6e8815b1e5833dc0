"""``/ready``: 200 only while the upstream engine answers (gateway mode), else 503 naming it; a
shared Redis cache that does not answer degrades the server (named, still 200); ``/health``
stays liveness. Real servers on loopback: a stand-in upstream stopped and started again on its
port, and a real redis-server."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from redis_server import RedisServer

openai = pytest.importorskip("openai")

from aiomm.server import ServerConfig, create_app  # noqa: E402
from aiomm.server.gateway import Upstream  # noqa: E402
from aiomm.server.readiness import DependencyDown, Readiness  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer  # noqa: E402
from upstream_standin import StandIn, UpstreamServer  # noqa: E402

#: how long a readiness report is reused in these servers
CACHE_S = 0.2


def _ready(server: LiveServer) -> httpx.Response:
    return httpx.get(server.url + "/ready", timeout=10)


def _await_ready(server: LiveServer, status: int, timeout: float = 10.0) -> httpx.Response:
    """``/ready`` once it answers ``status`` (reports are reused for ``CACHE_S``)."""
    deadline = time.monotonic() + timeout
    while True:
        r = _ready(server)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _await(
    server: LiveServer, done: Callable[[dict[str, Any]], bool], timeout: float = 10.0
) -> httpx.Response:
    """``/ready`` once its body satisfies ``done`` (reports are reused for ``CACHE_S``)."""
    deadline = time.monotonic() + timeout
    while True:
        r = _ready(server)
        if done(r.json()) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tokenizer(model_folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


def test_render_server_without_dependencies_is_ready(live_server: LiveServer) -> None:
    r = _ready(live_server)
    assert r.status_code == 200
    assert r.json() == {"ready": True, "down": [], "degraded": [], "checks": {}}
    assert httpx.get(live_server.url + "/readyz").json() == r.json()
    assert httpx.head(live_server.url + "/ready").status_code == 200


async def test_not_ready_before_the_app_has_started() -> None:
    app = create_app(ServerConfig(model="not-opened"))  # no lifespan: nothing is loaded
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://aiomm") as client:
        r = await client.get("/ready")
        assert (await client.get("/health")).status_code == 503
    assert r.status_code == 503
    assert r.json() == {
        "ready": False,
        "down": ["server"],
        "degraded": [],
        "checks": {"server": {"ok": False, "error": "starting or stopping"}},
    }


def test_gateway_readiness_follows_the_upstream(model_folder: Path, tokenizer: Any) -> None:
    """Up, down (``/health`` still 200, requests 502), and up again on the same port."""
    standin = StandIn(tokenizer.encode("A red car.", add_special_tokens=False))
    upstream = UpstreamServer(standin)
    port = upstream.port
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        upstream=upstream.url,
        ready_cache_s=CACHE_S,
    )
    messages = [{"role": "user", "content": "Describe a car."}]
    with upstream, LiveServer(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = _await_ready(server, 200)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "ready": True,
            "down": [],
            "degraded": [],
            "checks": {"upstream": {"ok": True}},
        }
        upstream.__exit__(None, None, None)  # the engine goes away

        down = _await_ready(server, 503)
        assert down.status_code == 503, down.text
        body = down.json()
        assert body["ready"] is False and body["down"] == ["upstream"]
        assert body["checks"]["upstream"]["error"] == "unreachable (ConnectError)"
        assert str(port) not in down.text  # no address in the report
        assert httpx.get(server.url + "/health").status_code == 200  # liveness is unchanged
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=RECORDED_MODEL, messages=messages)

        with UpstreamServer(standin, port=port):  # back, where it was
            back = _await_ready(server, 200)
            assert back.status_code == 200, back.text
            out = client.chat.completions.create(model=RECORDED_MODEL, messages=messages)
            assert out.choices[0].message.content == "A red car."
        client.close()


def test_a_probe_storm_sends_the_upstream_one_check(model_folder: Path, tokenizer: Any) -> None:
    standin = StandIn(tokenizer.encode("Hi.", add_special_tokens=False))
    with UpstreamServer(standin) as upstream:
        config = ServerConfig(model=str(model_folder), upstream=upstream.url, ready_cache_s=30.0)
        with LiveServer(config) as server:

            async def storm() -> list[int]:
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                    statuses: list[int] = []

                    async def probe() -> None:
                        statuses.append((await client.get("/ready")).status_code)

                    async with anyio.create_task_group() as tg:
                        for _ in range(50):
                            tg.start_soon(probe)
                    return statuses

            assert anyio.run(storm) == [200] * 50
    assert standin.health_probes == 1


@pytest.fixture
def redis_down(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server on a reserved port, not started yet (stopped at the end)."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def test_readiness_follows_a_shared_redis(model_folder: Path, redis_down: RedisServer) -> None:
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        shared_cache_url=redis_down.url,
        ready_cache_s=CACHE_S,
    )
    with LiveServer(config) as server:  # starts with Redis down: the engine computes locally
        r = _ready(server)
        # degraded, still ready: taking every replica out for a cache outage serves nobody
        assert r.status_code == 200, r.text
        assert r.json()["down"] == [] and r.json()["degraded"] == ["shared_cache"]
        assert r.json()["checks"]["shared_cache"]["ok"] is False
        assert str(redis_down.port) not in r.text
        assert httpx.get(server.url + "/health").status_code == 200
        redis_down.start()
        up = _await(server, lambda body: body["checks"]["shared_cache"]["ok"])
        assert up.json() == {
            "ready": True,
            "down": [],
            "degraded": [],
            "checks": {"shared_cache": {"ok": True}},
        }
        redis_down.kill()
        again = _await(server, lambda body: not body["checks"]["shared_cache"]["ok"])
        assert again.status_code == 200 and again.json()["degraded"] == ["shared_cache"]


async def test_a_silent_upstream_fails_the_check_within_its_timeout() -> None:
    """An upstream that accepts connections and never answers (a hung process)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        upstream = Upstream(f"http://127.0.0.1:{port}", tokenizer=None, pool=None)  # type: ignore[arg-type]
        try:
            readiness = Readiness({"upstream": upstream.check_health}, timeout_s=0.3)
            t0 = time.monotonic()
            report = await readiness.report()
            took = time.monotonic() - t0
        finally:
            await upstream.aclose()
    assert not report.ready and 0.3 <= took < 1.5
    assert report.body()["checks"]["upstream"] == {"ok": False, "error": "no answer within 0.3 s"}


async def test_reports_are_shared_and_reused_for_cache_s() -> None:
    calls: list[str] = []
    healthy = True

    async def check() -> None:
        calls.append("check")
        await anyio.sleep(0.05)
        if not healthy:
            raise DependencyDown("/health answered 503")

    async def broken() -> None:
        raise OSError("connect to 10.0.0.1:6379 refused")

    readiness = Readiness({"upstream": check}, timeout_s=1.0, cache_s=0.3)
    reports = []

    async def probe() -> None:
        reports.append(await readiness.report())

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(probe)
    assert len(calls) == 1 and all(r.ready for r in reports)
    healthy = False
    assert (await readiness.report()).ready  # still the cached report
    await anyio.sleep(0.3)
    report = await readiness.report()
    assert len(calls) == 2 and report.body() == {
        "ready": False,
        "down": ["upstream"],
        "degraded": [],
        "checks": {"upstream": {"ok": False, "error": "/health answered 503"}},
    }
    both = await Readiness(
        {"upstream": check, "shared_cache": broken}, optional=frozenset({"shared_cache"})
    ).report()
    # an unexpected error is reported by its type only: its message may hold an address
    assert both.failures == {
        "upstream": "/health answered 503",
        "shared_cache": "unreachable (OSError)",
    }
