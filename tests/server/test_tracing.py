"""OpenTelemetry tracing: one request's spans form one tree, from the client's ``traceparent``
through the gateway's render and engine stages to the upstream engine's span; with no tracer
provider configured, every span is the shared no-op.

The traced run is a fresh interpreter (a tracer provider is set once per process, for good):
the OpenTelemetry SDK's in-memory exporter, the stand-in engine and ``aiomm serve --upstream``
on loopback, the official ``openai`` client carrying a ``traceparent``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")

sys.path.insert(0, str(Path(__file__).parents[1] / "support"))
from fresh_python import run_python

SCRIPT = r"""
import base64, json, sys, threading, time
sys.path.insert(0, {conftest!r})
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

import openai, uvicorn
from conftest import LiveServer, free_port
import httpx
from aiomm.config import EngineConfig
from aiomm.media.samples import encode, photo_like
from aiomm.server import ServerConfig
from aiomm.server.standin import create_standin_app
import numpy as np

port = free_port()
standin = create_standin_app("qwen2-vl")
upstream = uvicorn.Server(uvicorn.Config(standin.app, host="127.0.0.1", port=port,
                                         log_level="warning"))
threading.Thread(target=upstream.run, daemon=True).start()
for _ in range(300):
    try:
        if httpx.get(f"http://127.0.0.1:{{port}}/health").status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.1)
config = ServerConfig(model="qwen2-vl", upstream=f"http://127.0.0.1:{{port}}",
                      engine=EngineConfig(device="cpu"))
image = encode(photo_like(np.random.default_rng(0), 120, 160), "JPEG")
url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
with LiveServer(config) as server:
    tracer = trace.get_tracer("client")
    with tracer.start_as_current_span("client") as client_span:
        headers = {{}}
        propagate.inject(headers)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               default_headers=headers)
        answer = client.chat.completions.create(model="qwen2-vl", max_tokens=4, messages=[
            {{"role": "user", "content": [{{"type": "image_url", "image_url": {{"url": url}}}},
                                          {{"type": "text", "text": "Describe it."}}]}}])
    assert answer.choices[0].message.content is not None
    with tracer.start_as_current_span("streaming client"):
        headers = {{}}
        propagate.inject(headers)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               default_headers=headers)
        chunks = list(client.chat.completions.create(model="qwen2-vl", max_tokens=4,
            stream=True, messages=[{{"role": "user", "content": "Say hi."}}]))
        assert chunks
upstream.should_exit = True
time.sleep(0.2)
spans = [
    {{"name": s.name, "id": s.context.span_id, "trace": s.context.trace_id,
      "parent": s.parent.span_id if s.parent else None, "attributes": dict(s.attributes or {{}}),
      "status": s.status.status_code.name}}
    for s in exporter.get_finished_spans()
]
print("SPANS " + json.dumps(spans))
"""


def test_one_request_is_one_trace_across_the_gateway_and_the_upstream() -> None:
    conftest = str(Path(__file__).parent)
    # (no working directory on sys.path: the checkout's kernels/ must not shadow a package)
    done = run_python(SCRIPT.format(conftest=conftest), env={"PYTHONSAFEPATH": "1"}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("SPANS "))
    spans = json.loads(line.removeprefix("SPANS "))
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    (client,) = by_name["client"]
    (streaming,) = by_name["streaming client"]
    assert {s["trace"] for s in spans} == {client["trace"], streaming["trace"]}
    ids = {s["id"]: s for s in spans}
    # the streamed answer: the engine's span continues the render's, as its call outlives it
    streamed = [s for s in spans if s["trace"] == streaming["trace"]]
    (streamed_render,) = [s for s in streamed if s["name"] == "aiomm.render"]
    (streamed_engine,) = [s for s in streamed if s["name"] == "aiomm.standin.generate"]
    assert streamed_engine["parent"] == streamed_render["id"]
    spans = [s for s in spans if s["trace"] == client["trace"]]
    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)

    def parent(s: dict) -> str:
        return ids[s["parent"]]["name"]

    (render,) = [s for s in by_name["aiomm.render"] if s["parent"] == client["id"]]
    assert render["attributes"]["http.response.status_code"] == 200
    (request,) = by_name["aiomm.request"]
    assert parent(request) == "aiomm.render"
    for stage in ("aiomm.admission", "aiomm.fetch", "aiomm.hash", "aiomm.cache", "aiomm.assemble"):
        assert [parent(s) for s in by_name[stage]] == ["aiomm.request"], stage
    assert parent(by_name["aiomm.transform"][0]) == "aiomm.cache"
    assert by_name["aiomm.cache"][0]["attributes"]["aiomm.cache.outcome"] == "miss"
    assert parent(by_name["aiomm.encode"][0]) == "aiomm.render"
    (call,) = by_name["aiomm.upstream"]
    assert parent(call) == "aiomm.render"
    (engine,) = by_name["aiomm.standin.generate"]
    assert engine["parent"] == call["id"], "the upstream's span continues the gateway's call"
    assert all(s["status"] != "ERROR" for s in spans)


def test_without_a_tracer_provider_spans_cost_nothing() -> None:
    from aiomm import tracing

    assert not tracing.tracing_enabled()  # this process configured no provider
    assert tracing.span("aiomm.request") is tracing.span("aiomm.fetch")  # the shared no-op
    assert (
        tracing.extract_context({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    )
    headers: dict[str, str] = {}
    tracing.inject_context(headers)
    assert headers == {}
