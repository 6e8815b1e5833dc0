"""``aiomm serve --api-key`` / ``VLLM_API_KEY``: the paths vLLM 0.33 guards answer its 401
``{"error":"Unauthorized"}`` without a right Bearer key, the others stay open, with httpx and with
the official openai client; the keys reach ``--workers N`` and never a log or a metric.

vLLM's answers these match, byte for byte, were read from a live ``vllm launch render --api-key
k1 k2`` (``vllm/entrypoints/serve/middleware/authenticate.py``): status 401, body
``{"error":"Unauthorized"}``, ``content-type: application/json``, no ``WWW-Authenticate``.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from aiomm.cli import main  # noqa: E402
from aiomm.server import ServerConfig  # noqa: E402
from aiomm.server.auth import api_keys, upstream_api_key  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer  # noqa: E402
from upstream_standin import StandIn, UpstreamServer  # noqa: E402

KEYS = ("first-key-" + secrets.token_hex(8), "second-key-" + secrets.token_hex(8))
UNAUTHORIZED = b'{"error":"Unauthorized"}'

#: every route aiomm serves under a guarded prefix, a body it takes, and its status with a key
GUARDED: list[tuple[str, str, dict[str, Any] | None, int]] = [
    (
        "POST",
        "/v1/chat/completions/render",
        {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": "Hi."}]},
        200,
    ),
    ("POST", "/v1/responses/render", {"model": RECORDED_MODEL, "input": "Hi."}, 200),
    (
        "POST",
        "/v1/messages/render",
        {"model": RECORDED_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
        200,
    ),
    ("POST", "/v1/completions/render", {"model": RECORDED_MODEL, "prompt": "Hi."}, 200),
    ("GET", "/v1/models", None, 200),
    # gateway routes: without --upstream they answer 404, past the key
    ("POST", "/v1/chat/completions", {"model": RECORDED_MODEL, "messages": []}, 404),
    ("POST", "/v1/completions", {"model": RECORDED_MODEL, "prompt": "Hi."}, 404),
    # vLLM matches prefixes: paths no route serves are refused before they are not found
    ("GET", "/v1/nothing", None, 404),
    ("GET", "/v10", None, 404),
    ("GET", "/v2/models", None, 404),
    ("POST", "/inference/v1/generate", {}, 404),
    ("GET", "/cohere/v1/chat", None, 404),
]
#: left open by vLLM (and by aiomm)
OPEN: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/health", None),
    ("GET", "/ready", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"model": RECORDED_MODEL, "prompt": "Hi."}),
]


@pytest.fixture(scope="module")
def keyed(model_folder: Path) -> Iterator[LiveServer]:
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        api_keys=KEYS,
    )
    with LiveServer(config) as server:
        yield server


def _send(server: LiveServer, method: str, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)


def _refused(r: httpx.Response) -> bool:
    return (
        r.status_code == 401
        and r.content == UNAUTHORIZED
        and r.headers["content-type"] == "application/json"
        and "www-authenticate" not in r.headers
    )


@pytest.mark.parametrize(("method", "path", "body", "status"), GUARDED, ids=[g[1] for g in GUARDED])
def test_guarded_routes_need_a_right_key(
    keyed: LiveServer, method: str, path: str, body: Any, status: int
) -> None:
    assert _refused(_send(keyed, method, path, body))
    assert _refused(_send(keyed, method, path, body, authorization="Bearer wrong"))
    assert _refused(_send(keyed, method, path, body, authorization=f"Bearer {KEYS[0]}x"))
    for key in KEYS:  # any of the keys
        r = _send(keyed, method, path, body, authorization=f"Bearer {key}")
        assert r.status_code == status, r.text


@pytest.mark.parametrize(("method", "path", "body"), OPEN, ids=[o[1] for o in OPEN])
def test_open_routes_take_any_key_or_none(
    keyed: LiveServer, method: str, path: str, body: Any
) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {KEYS[0]}"}):
        r = _send(keyed, method, path, body, **headers)
        assert r.status_code == 200, (headers, r.text)


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        (f"Bearer {KEYS[1]}", True),
        (f"bearer {KEYS[1]}", True),  # the scheme is case-insensitive
        (f"BEARER {KEYS[1]}", True),
        (f"Basic {KEYS[1]}", False),
        (f"Bearer  {KEYS[1]}", False),  # the token is all that follows the first space
        (f"Bearer{KEYS[1]}", False),
        ("Bearer", False),
        (KEYS[1], False),
    ],
)
def test_the_authorization_header_is_read_as_vllm_reads_it(
    keyed: LiveServer, header: str, accepted: bool
) -> None:
    r = _send(keyed, "GET", "/v1/models", None, authorization=header)
    assert (r.status_code == 200) is accepted
    assert _refused(r) is not accepted


def test_other_headers_and_preflights(keyed: LiveServer) -> None:
    assert _refused(_send(keyed, "GET", "/v1/models", None, **{"x-api-key": KEYS[0]}))
    # OPTIONS passes the check (CORS preflights), as in vLLM: the route then refuses the method
    assert _send(keyed, "OPTIONS", "/v1/models", None).status_code == 405


def test_openai_client_sends_its_key_as_a_bearer_token(keyed: LiveServer) -> None:
    body = {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": "Hi."}]}
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[0], max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [RECORDED_MODEL]
        for path in ("/chat/completions/render", "/completions/render"):
            rendered = client.post(path, cast_to=object, body=body if "chat" in path else {
                "model": RECORDED_MODEL, "prompt": "Hi."})  # fmt: skip
            assert rendered, path
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.models.list()
        assert refused.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client.post("/chat/completions/render", cast_to=object, body=body)


async def test_async_openai_client(keyed: LiveServer) -> None:
    client = openai.AsyncOpenAI(base_url=keyed.url + "/v1", api_key=KEYS[1], max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [RECORDED_MODEL]
    finally:
        await client.close()


def test_keys_stay_out_of_logs_metrics_and_the_config_repr(
    model_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="aiomm")  # a level another test left on it
    config = ServerConfig(model=str(model_folder), api_keys=KEYS, upstream_api_key="up-" + KEYS[0])
    assert all(k not in repr(config) for k in KEYS)
    with LiveServer(config) as server:
        for key in (None, "wrong", KEYS[0]):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            httpx.post(server.url + "/v1/chat/completions/render", json={"messages": 1},
                       headers=headers)  # fmt: skip
        metrics = httpx.get(server.url + "/metrics").text
    logged = caplog.text + "".join(repr(r.__dict__) for r in caplog.records)
    assert "server_open" in logged
    assert all(k not in logged and k not in metrics for k in KEYS)


def test_keys_come_from_the_flag_or_vllms_variable() -> None:
    env = {"VLLM_API_KEY": "from-env"}
    assert api_keys(None, env) == ("from-env",)
    assert api_keys(["a", "b"], env) == ("a", "b")  # the flag wins, as in vLLM
    assert api_keys([], env) == ("from-env",)
    assert api_keys(None, {}) == ()
    assert api_keys(None, {"VLLM_API_KEY": ""}) == ()  # empty: no key
    assert api_keys(None, {"VLLM_API_KEY": "a,b"}) == ("a,b",)  # one key, no separator
    assert api_keys(["", "a"], {}) == ("a",)
    assert upstream_api_key(None, {"AIOMM_UPSTREAM_API_KEY": "up"}) == "up"
    assert upstream_api_key("flag", {"AIOMM_UPSTREAM_API_KEY": "up"}) == "flag"
    assert upstream_api_key(None, {"AIOMM_UPSTREAM_API_KEY": ""}) is None


def test_serve_passes_the_keys_on(model_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[ServerConfig] = []
    monkeypatch.setattr(
        "aiomm.server.serve.serve", lambda config, **kwargs: served.append(config) or 0
    )
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("AIOMM_UPSTREAM_API_KEY", raising=False)
    assert main(["serve", str(model_folder)]) == 0
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    monkeypatch.setenv("AIOMM_UPSTREAM_API_KEY", "env-upstream")
    assert main(["serve", str(model_folder)]) == 0
    assert main(["serve", str(model_folder), "--api-key", "a", "b", "--upstream-api-key", "u"]) == 0
    got = [(c.api_keys, c.upstream_api_key) for c in served]
    assert got == [((), None), (("env-key",), "env-upstream"), (("a", "b"), "u")]


def test_serve_workers_take_the_key_from_the_environment(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aiomm serve --workers 2`` with ``VLLM_API_KEY``: both workers (which build their app
    from the configuration the supervisor hands them) refuse a request without the key, and the
    key is in no line the server printed."""
    from test_serve_cli import _listening, _start, _stop

    key = "worker-key-" + secrets.token_hex(12)
    monkeypatch.setenv("VLLM_API_KEY", key)
    proc, url = _start(model_folder, "--workers", "2", "--cache-gb", "0.25", "--no-cache-pretouch")
    try:
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 120
        while len(_listening(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_listening(port)) == 2
        for _ in range(8):  # a new connection each: the kernel hands them to either worker
            assert _refused(httpx.get(url + "/v1/models", timeout=10))
            ok = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == RECORDED_MODEL
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        _stop(proc)
    assert b"server_open" in out and key.encode() not in out


CLIENT_KEY = "client-key-" + secrets.token_hex(8)
UPSTREAM_KEY = "upstream-key-" + secrets.token_hex(8)
REPLY = "The picture shows a red car."


@pytest.fixture(scope="module")
def keyed_gateway(model_folder: Path) -> Iterator[tuple[LiveServer, StandIn, UpstreamServer]]:
    """A gateway that takes ``CLIENT_KEY`` in front of a stand-in engine that takes only
    ``UPSTREAM_KEY``."""
    from transformers import AutoTokenizer

    script = AutoTokenizer.from_pretrained(model_folder).encode(REPLY, add_special_tokens=False)
    standin = StandIn([*script, 151645], api_key=UPSTREAM_KEY)
    with UpstreamServer(standin) as upstream:
        config = ServerConfig(
            model=str(model_folder),
            model_id=RECORDED_MODEL,
            served_model_names=(RECORDED_MODEL,),
            upstream=upstream.url,
            api_keys=(CLIENT_KEY,),
            upstream_api_key=UPSTREAM_KEY,
        )
        with LiveServer(config) as server:
            yield server, standin, upstream


def test_gateway_sends_the_upstream_its_own_key(keyed_gateway: Any) -> None:
    server, standin, _ = keyed_gateway
    messages = [{"role": "user", "content": "Describe a car."}]
    before = len(standin.authorizations)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_KEY, max_retries=0) as client:
        out = client.chat.completions.create(model=RECORDED_MODEL, messages=messages)
        assert out.choices[0].message.content == REPLY
        stream = client.chat.completions.create(
            model=RECORDED_MODEL, messages=messages, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == REPLY
        done = client.completions.create(model=RECORDED_MODEL, prompt="Tell me", max_tokens=3)
        assert done.choices[0].finish_reason == "length"
    assert httpx.get(server.url + "/ready").status_code == 200  # probes the upstream's /health
    seen = standin.authorizations[before:]
    assert len(seen) == 4 and standin.health_probes >= 1
    assert seen == [f"Bearer {UPSTREAM_KEY}"] * 4  # never the client's key
    with openai.OpenAI(base_url=server.url + "/v1", api_key=UPSTREAM_KEY, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):  # the upstream's key opens nothing here
            client.chat.completions.create(model=RECORDED_MODEL, messages=messages)
    assert len(standin.authorizations) == before + 4  # refused before reaching the upstream


@pytest.mark.parametrize("upstream_key", [None, "wrong-upstream-key"], ids=["none", "wrong"])
def test_gateway_with_a_key_the_upstream_refuses(
    keyed_gateway: Any, model_folder: Path, upstream_key: str | None
) -> None:
    """The stand-in refuses a missing or wrong key with vLLM's 401; the client gets a 502 (the
    gateway's configuration is at fault, not the client's key), never a 401."""
    _, standin, upstream = keyed_gateway
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        upstream=upstream.url,
        api_keys=(CLIENT_KEY,),
        upstream_api_key=upstream_key,
    )
    messages = [{"role": "user", "content": "Hi."}]
    seen = len(standin.seen)
    with LiveServer(config) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_KEY, max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as refused:
                c.chat.completions.create(model=RECORDED_MODEL, messages=messages)
        assert refused.value.status_code == 502 and "upstream answered 401" in str(refused.value)
        body = {"model": RECORDED_MODEL, "messages": messages, "stream": True}
        headers = {"authorization": f"Bearer {CLIENT_KEY}"}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200 and "upstream answered 401" in r.text
        assert r.text.endswith("data: [DONE]\n\n")
    assert len(standin.seen) == seen  # refused, not served
    wrong = [a for a in standin.authorizations if a != f"Bearer {UPSTREAM_KEY}"]
    assert wrong[-2:] == [None if upstream_key is None else f"Bearer {upstream_key}"] * 2
    assert all(CLIENT_KEY not in (a or "") for a in standin.authorizations)


def test_workers_get_the_keys_with_their_configuration() -> None:
    from aiomm.server.serve import _from_env, _to_env, worker_config

    config = ServerConfig(model="m", upstream="http://e", api_keys=KEYS, upstream_api_key="u")
    carried = _from_env(_to_env(worker_config(config, 2)))
    assert carried.api_keys == KEYS and carried.upstream_api_key == "u"
