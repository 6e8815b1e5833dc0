"""Request fields of the wrong type or out of range are a 400 naming the field, never a 500,
and the next request renders; engine refusals map to the status a client acts on.

(vLLM's own answers for many of these bodies are golden fixtures: ``fixtures/error_*.json``,
``chat_lax_values.json``, ``chat_max_tokens_above_the_room.json``.)
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from aiomm.errors import EngineClosedError, ItemCountMismatchError, OverloadedError
from aiomm.server import ServerConfig, create_app
from aiomm.vllm.errors import ApiError, from_aiomm_error
from aiomm.vllm.request_values import INT64_MAX, flag, lax_bool, lax_float, lax_int
from aiomm.vllm.sampling import SamplingDefaults, derive

CASE = json.loads((Path(__file__).parent / "fixtures" / "chat_jpeg.json").read_text())
ANTHROPIC = json.loads((Path(__file__).parent / "fixtures" / "messages_anthropic.json").read_text())
RESPONSES = json.loads(
    (Path(__file__).parent / "fixtures" / "responses_input_image.json").read_text()
)
IMAGE = CASE["body"]["messages"][0]["content"][1]


def _chat(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(CASE["body"]), **fields}


def _parts(*parts: dict[str, Any]) -> dict[str, Any]:
    body = _chat()
    body["messages"][0]["content"] = [CASE["body"]["messages"][0]["content"][0], *parts]
    return body


def _anthropic(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    body = copy.deepcopy(ANTHROPIC["body"])
    edit(body)
    return body


def _bad_png() -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    return {"type": "image_url", "image_url": {"url": url}}


# (endpoint, body, the param the error names or None, a word of its message)
BAD: dict[str, tuple[str, dict[str, Any], str | None, str]] = {
    "role_is_a_list": (
        CASE["path"],
        {"messages": [{"role": ["user"], "content": "hi"}]},
        "messages",
        "role",
    ),
    "chat_template_kwargs_a_string": (
        CASE["path"],
        _chat(chat_template_kwargs="x"),
        "chat_template_kwargs",
        "object",
    ),
    "chat_template_kwargs_pairs": (
        CASE["path"],
        _chat(chat_template_kwargs=[["a", 1]]),
        "chat_template_kwargs",
        "object",
    ),
    # a template of the client's own, slipped in through the kwargs (vLLM refuses it too)
    "chat_template_in_the_kwargs": (
        CASE["path"],
        _chat(chat_template_kwargs={"chat_template": "{{ 'INJECTED' }}"}),
        "chat_template_kwargs",
        "unexpected chat template kwargs",
    ),
    "tokenize_in_the_kwargs": (
        ANTHROPIC["path"],
        _anthropic(lambda b: b.update(chat_template_kwargs={"tokenize": True})),
        "chat_template_kwargs",
        "'tokenize'",
    ),
    # checked before the media are fetched: the field's 400, not the (unreachable) URL's
    "parallel_tool_calls_a_word_with_a_url": (
        CASE["path"],
        {
            **_parts({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.jpg"}}),
            "parallel_tool_calls": "maybe",
        },
        "parallel_tool_calls",
        "parallel_tool_calls",
    ),
    "include_reasoning_a_word_with_a_url": (
        CASE["path"],
        {
            **_parts({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.jpg"}}),
            "include_reasoning": "maybe",
        },
        "include_reasoning",
        "include_reasoning",
    ),
    "priority_a_word": (CASE["path"], _chat(priority="abc"), "priority", "integer"),
    "priority_beyond_64_bits": (CASE["path"], _chat(priority=10**20), "priority", "got"),
    "stop_token_ids_an_int": (CASE["path"], _chat(stop_token_ids=5), "stop_token_ids", "list"),
    "stop_token_ids_a_string": (
        CASE["path"],
        _chat(stop_token_ids="abc"),
        "stop_token_ids",
        "list",
    ),
    # orjson reads integers beyond 64 bits as floats: 1e20 either way
    "max_tokens_1e20": (CASE["path"], _chat(max_tokens=1e20), "max_tokens", "max_tokens"),
    "max_tokens_above_context": (
        CASE["path"],
        _chat(max_completion_tokens=40000),
        "max_completion_tokens",
        "max_model_len=32768",
    ),
    "max_tokens_a_fraction": (CASE["path"], _chat(max_tokens=5.5), "max_tokens", "integer"),
    "seed_beyond_64_bits": (CASE["path"], _chat(seed=2**64), "seed", "seed"),
    "top_k_beyond_64_bits": (CASE["path"], _chat(top_k=10**20), "top_k", "top_k"),
    "top_k_below_minus_one": (CASE["path"], _chat(top_k=-5), "top_k", "top_k"),
    "top_p_above_one": (CASE["path"], _chat(top_p=2.0), "top_p", "(0, 1]"),
    "temperature_above_two": (CASE["path"], _chat(temperature=2.5), "temperature", "[0, 2]"),
    "presence_penalty_a_word": (
        CASE["path"],
        _chat(presence_penalty="lots"),
        "presence_penalty",
        "number",
    ),
    "stream_a_word": (CASE["path"], _chat(stream="maybe"), "stream", "boolean"),
    "add_generation_prompt_a_list": (
        CASE["path"],
        _chat(add_generation_prompt=[]),
        "add_generation_prompt",
        "boolean",
    ),
    "model_a_list": (CASE["path"], _chat(model=["x"]), "model", "string"),
    "file_url_with_an_open_bracket": (
        CASE["path"],
        _parts({"type": "image_url", "image_url": {"url": "file://[x/y"}}),
        None,
        "InvalidSourceError",
    ),
    "second_of_two_images_undecodable": (CASE["path"], _parts(IMAGE, _bad_png()), None, "Decode"),
    "second_of_two_images_bad_base64": (
        CASE["path"],
        _parts(IMAGE, {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}),
        None,
        "base64",
    ),
    "second_of_two_images_blocked": (
        CASE["path"],
        _parts(IMAGE, {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x"}}),
        "image_url",
        "Blocked",
    ),
    "image_token_typed_in_the_text": (
        CASE["path"],
        _parts({"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}, IMAGE),
        "messages",
        "ItemCountMismatchError",
    ),
    # what aiomm does not reproduce is refused, never answered differently from vLLM
    "response_format_json": (
        CASE["path"],
        _chat(response_format={"type": "json_object"}),
        "response_format",
        "structured outputs",
    ),
    "tools": (
        CASE["path"],
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        "tools",
        "tool definitions",
    ),
    "truncation_with_an_image": (
        CASE["path"],
        _chat(truncate_prompt_tokens=5),
        "truncate_prompt_tokens",
        "placeholders",
    ),
    "anthropic_thinking": (
        ANTHROPIC["path"],
        _anthropic(lambda b: b.update(thinking={"type": "enabled", "budget_tokens": 16})),
        "thinking",
        "thinking",
    ),
    "responses_json_format": (
        RESPONSES["path"],
        {"input": "hi", "text": {"format": {"type": "json_object"}}},
        "text",
        "structured outputs",
    ),
    "logit_bias_key_not_a_token": (
        CASE["path"],
        _chat(logit_bias={"five": 1.0}),
        "logit_bias",
        "token id",
    ),
    "vllm_xargs_a_string": (CASE["path"], _chat(vllm_xargs="x"), "vllm_xargs", "object"),
    "documents_a_string": (CASE["path"], _chat(documents="x"), "documents", "list"),
    "reasoning_effort_unknown": (
        CASE["path"],
        _chat(reasoning_effort="huge"),
        "reasoning_effort",
        "reasoning_effort",
    ),
    "reasoning_effort_a_list": (
        CASE["path"],
        _chat(reasoning_effort=[1]),
        "reasoning_effort",
        "reasoning_effort",
    ),
    "completion_prompt_empty": (
        "/v1/completions/render",
        {"prompt": ""},
        "prompt",
        "non-empty",
    ),
    "completion_prompt_mixed": (
        "/v1/completions/render",
        {"prompt": ["a", [5]]},
        "prompt",
        "integer",
    ),
    "anthropic_source_a_string": (
        ANTHROPIC["path"],
        _anthropic(lambda b: b["messages"][0]["content"][0].update(source="abc")),
        "messages",
        "source",
    ),
    "anthropic_system_a_number": (
        ANTHROPIC["path"],
        _anthropic(lambda b: b.update(system=5)),
        "system",
        "system",
    ),
    "anthropic_system_text_a_number": (
        ANTHROPIC["path"],
        _anthropic(lambda b: b.update(system=[{"type": "text", "text": 5}])),
        "system",
        "text",
    ),
    "responses_text_a_number": (
        RESPONSES["path"],
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        "input",
        "text",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_field_is_a_400_naming_it_and_the_next_request_renders(
    live_server: Any, name: str
) -> None:
    path, body, param, word = BAD[name]
    r = httpx.post(live_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert word in error["message"]
    ok = httpx.post(live_server.url + CASE["path"], json=CASE["body"], timeout=60)
    assert ok.status_code == 200
    assert ok.json()["features"]["mm_hashes"] == CASE["response"]["features"]["mm_hashes"]


def test_lax_values_and_a_clamped_max_tokens_render_as_vllm_reads_them(live_server: Any) -> None:
    body = _chat(
        max_tokens="7", seed=3.0, top_k="3", stop_token_ids=[3.0, "5", True], priority="-2"
    )
    r = httpx.post(live_server.url + CASE["path"], json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    sp = out["sampling_params"]
    assert (sp["max_tokens"], sp["seed"], sp["top_k"], sp["stop_token_ids"]) == (7, 3, 3, [3, 5, 1])
    assert out["priority"] == -2 and sp["output_kind"] == 2
    room = 32768 - len(out["token_ids"])
    r = httpx.post(
        live_server.url + CASE["path"], json=_chat(max_tokens=32768, stream="true"), timeout=60
    )
    assert r.status_code == 200, r.text
    sp = r.json()["sampling_params"]
    assert sp["max_tokens"] == room and sp["output_kind"] == 1  # DELTA when streaming


def test_a_client_request_id_names_the_request(live_server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "request_id": "client-7"}
    r = httpx.post(live_server.url + CASE["path"], json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["request_id"] == "chatcmpl-client-7"
    r = httpx.post(live_server.url + CASE["path"], json={**body, "request_id": 7}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_an_x_request_id_header_names_the_request_as_in_vllm(live_server: Any) -> None:
    def rid(path: str, body: dict[str, Any]) -> Any:
        r = httpx.post(live_server.url + path, json=body, headers={"X-Request-Id": "hdr"})
        assert r.status_code == 200, r.text
        out = r.json()
        return [g["request_id"] for g in out] if isinstance(out, list) else out["request_id"]

    chat = {"messages": [{"role": "user", "content": "hi"}], "request_id": "body"}
    assert rid(CASE["path"], chat) == "chatcmpl-hdr"  # the header wins over the body
    assert rid("/v1/completions/render", {"prompt": ["a", "b"]}) == ["cmpl-hdr-0", "cmpl-hdr-1"]
    anthropic = {**ANTHROPIC["body"], "messages": [{"role": "user", "content": "hi"}]}
    assert rid(ANTHROPIC["path"], anthropic) == "chatcmpl-hdr"
    assert rid(RESPONSES["path"], {"input": "hi"}).startswith("resp_")  # no header there
    assert rid(RESPONSES["path"], {"input": "hi", "request_id": "mine"}) == "mine"


def test_models_before_the_lifespan_is_a_json_503(model_folder: Path) -> None:
    app = create_app(ServerConfig(model=str(model_folder)))
    client = TestClient(app)  # no ``with``: the lifespan never runs
    r = client.get("/v1/models")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (OverloadedError(4, 8), 503),
        (EngineClosedError("the engine is not open"), 503),
        (ItemCountMismatchError("image", 1, 2), 400),
    ],
)
def test_engine_refusals_map_to_what_a_client_acts_on(error: Exception, status: int) -> None:
    api = from_aiomm_error(error)  # type: ignore[arg-type]
    assert api.status == status
    assert type(error).__name__ in api.message


def test_lax_readers() -> None:
    assert [lax_int(v, "n") for v in (7, 7.0, "7", " 7 ", "7.0", True)] == [7, 7, 7, 7, 7, 1]
    assert lax_int(INT64_MAX, "n") == INT64_MAX
    for bad in (7.5, "seven", None, [7], {"n": 7}, float("inf"), 2**63, 1e20):
        with pytest.raises(ApiError) as info:
            lax_int(bad, "n")
        assert info.value.param == "n" and info.value.status == 400
    with pytest.raises(ApiError, match=r"\[-1, "):
        lax_int(-2, "top_k", lo=-1)
    assert [lax_float(v, "x") for v in (1, 0.5, "0.25", True)] == [1.0, 0.5, 0.25, 1.0]
    for bad in ("nan", "inf", "warm", [1.0]):
        with pytest.raises(ApiError):
            lax_float(bad, "x")
    assert [lax_bool(v, "b") for v in (True, 0, 1, "yes", "OFF", "t")] == [
        True,
        False,
        True,
        True,
        False,
        True,
    ]
    for bad in (2, "maybe", " true", 0.5, None):
        with pytest.raises(ApiError):
            lax_bool(bad, "b")
    assert flag({}, "stream", False) is False
    assert flag({"stream": None}, "stream", True) is True
    assert flag({"stream": "no"}, "stream", True) is False


def test_generation_config_defaults_as_vllm_takes_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "max_new_tokens": 100,
                "skip_special_tokens": False,
                "presence_penalty": 0.5,
                "do_sample": True,  # not a sampling param vLLM takes
                "top_k": None,
            }
        )
    )
    defaults = SamplingDefaults.from_folder(tmp_path)
    assert defaults.values == {
        "max_tokens": 100,
        "skip_special_tokens": False,
        "presence_penalty": 0.5,
    }
    chat = derive({}, defaults, 10, api="chat")
    assert chat["max_tokens"] == 100 and chat["skip_special_tokens"] is False
    assert chat["presence_penalty"] == 0.5 and "top_k" not in chat
    assert derive({"max_tokens": 50}, defaults, 10, api="chat")["max_tokens"] == 50
    assert derive({}, defaults, 4090, api="chat")["max_tokens"] == 6  # the room, below 100
    assert "max_tokens" not in derive({"prompt": "x"}, defaults, 10, api="completion")  # 16
    assert "skip_special_tokens" not in derive({"skip_special_tokens": True}, defaults, 10)


def test_long_prompt_text_is_rendered_off_the_event_loop(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import anyio
    from transformers import AutoTokenizer

    from aiomm.processing.tokenize import LONG_TEXT_CHARS
    from aiomm.vllm.chat_template import ChatRenderer

    chat = ChatRenderer(AutoTokenizer.from_pretrained(model_folder))
    threads: list[threading.Thread] = []
    encode = chat.encode

    def recorded(text: str) -> list[int]:
        threads.append(threading.current_thread())
        return encode(text)

    monkeypatch.setattr(chat, "encode", recorded)

    async def main() -> None:
        loop_thread = threading.current_thread()
        short, long = "hi " * 10, "hi " * (LONG_TEXT_CHARS // 3 + 1)
        for text in (short, long):
            conversation = [{"role": "user", "content": [{"type": "text", "text": text}]}]
            assert await chat.arender(conversation) == chat.render(conversation)
            assert await chat.aencode(text) == encode(text)
        # per text: arender's encode, the direct render's (on the loop), aencode's; the short
        # prompt's second render is the renderer's kept ids (no encode), the long one's is not
        on_loop = [t is loop_thread for t in threads]
        assert on_loop == [True, True, False, True, False]
        # a batch of completion prompts, each below the bound, together above it
        threads.clear()
        batch = ["hi " * (LONG_TEXT_CHARS // 6)] * 3
        assert await chat.aencode_all(batch) == [encode(t) for t in batch]
        assert [t is loop_thread for t in threads] == [False, False, False]
        threads.clear()
        assert await chat.aencode_all([short, short]) == [encode(short)] * 2
        assert [t is loop_thread for t in threads] == [True, True]

    anyio.run(main)


COMPLETION = json.loads((Path(__file__).parent / "fixtures" / "completions_text.json").read_text())


@pytest.mark.parametrize(
    ("path", "body", "fields"),
    [
        # vLLM's chat model has no suffix, prompt_embeds or output_config: pydantic drops them
        (CASE["path"], CASE["body"], {"suffix": "x", "prompt_embeds": "AAAA", "output_config": {}}),
        # chat's logprobs is a lax bool (vLLM reads "true" as true)
        (CASE["path"], {**CASE["body"], "logprobs": True}, {"logprobs": "true"}),
        # nor has its completion model tools, a chat template or processor kwargs
        (
            COMPLETION["path"],
            COMPLETION["body"],
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "chat_template": "{{ 'INJECTED' }}",
                "mm_processor_kwargs": {"max_pixels": 1},
                "output_config": {"effort": "high"},
                "top_logprobs": "3",  # not a completion field: never checked
            },
        ),
    ],
)
def test_fields_vllm_ignores_or_reads_laxly_render_as_in_vllm(
    live_server: Any, path: str, body: dict[str, Any], fields: dict[str, Any]
) -> None:
    plain = httpx.post(live_server.url + path, json=body, timeout=60)
    extra = httpx.post(live_server.url + path, json={**body, **fields}, timeout=60)
    assert plain.status_code == 200 and extra.status_code == 200, extra.text
    # the same answer, but for the random request id each response has
    docs = [r.json() for r in (plain, extra)]
    for doc in docs:
        for item in doc if isinstance(doc, list) else [doc]:
            item.pop("request_id")
    assert docs[1] == docs[0]


def test_own_fields_copies_a_chat_or_completion_body_only_when_it_drops_a_field() -> None:
    from aiomm.vllm.request_fields import own_fields

    body = _chat()
    assert own_fields(body, "chat") is body  # the usual body, on every request: no copy
    assert own_fields({**body, "suffix": "x"}, "chat") == body
    assert own_fields({"prompt": "x", "top_logprobs": "3"}, "completion") == {"prompt": "x"}
    assert own_fields({"prompt": "x", "top_logprobs": 3}, "chat")["top_logprobs"] == 3
