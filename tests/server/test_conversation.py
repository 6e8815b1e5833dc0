"""Each API's messages -> the conversation the chat template sees, as vLLM 0.33 builds it.

The golden fixtures prove the token ids for the recorded Qwen2-VL template, which ignores tool
calls and reasoning; these tests check what a template that renders them is given (the fields
vLLM's chat parser passes on) and the edge cases of the developer and system rewrites.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from aiomm.vllm.chat_template import ChatRenderer, _developer_as_system
from aiomm.vllm.content import parse_anthropic, parse_chat
from aiomm.vllm.errors import ApiError

_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def test_an_assistants_tool_calls_and_reasoning_reach_the_template() -> None:
    parsed = parse_chat(
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "ann"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning": "think",
                    "tool_calls": [
                        _CALL,
                        {**_CALL, "function": {"name": "g", "arguments": "not json"}},
                        {**_CALL, "function": {"name": "h"}},
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "done", "tool_calls": []},
            ]
        }
    )
    user, call, tool, done = parsed.conversation
    assert user == {"role": "user", "content": "hi", "name": "ann"}
    # arguments as objects, as vLLM's _postprocess_messages hands them on ({} when unreadable)
    assert [c["function"]["arguments"] for c in call["tool_calls"]] == [{"x": 1}, {}, {}]
    assert call["reasoning"] == call["reasoning_content"] == "think"
    assert call["content"] is None  # rendered empty; no text to continue
    assert tool == {"role": "tool", "content": "a\nb", "tool_call_id": "c1"}
    assert "tool_calls" not in done  # an empty list is dropped
    assert parsed.tool_call_count == 3  # vLLM's history_tool_call_cnt counts the request's own


@pytest.mark.parametrize(
    "calls", [{"id": "c"}, [5], [{"type": "custom", "function": {"name": "f"}}]]
)
def test_malformed_tool_calls_are_refused(calls: Any) -> None:
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}
    with pytest.raises(ApiError) as caught:
        parse_chat(body)
    assert caught.value.param == "tool_calls"


def test_developer_messages_merge_into_one_system_message() -> None:
    conversation = [
        {"role": "system", "content": ""},  # empty: dropped from the merge
        {"role": "user", "content": "u"},
        {"role": "developer", "content": [{"type": "text", "text": "d1"}, {"type": "image"}]},
        {"role": "developer", "content": "d2"},
    ]
    assert _developer_as_system(conversation) == [
        {"role": "system", "content": "d1\n\nd2"},  # text parts only
        {"role": "user", "content": "u"},
    ]
    # a lone developer message first is renamed, its content untouched
    alone = [{"role": "developer", "content": [{"type": "text", "text": "d"}]}, conversation[1]]
    assert _developer_as_system(alone) == [
        {"role": "system", "content": alone[0]["content"]},
        alone[1],
    ]


class _Tokenizer:
    """The least a ChatRenderer needs: a template, and a template call that shows what it got."""

    chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"  # no 'developer' role

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation: list[dict[str, Any]], **_: Any) -> str:
        self.seen = conversation
        return "x"


def test_the_renderer_rewrites_developer_messages_and_empty_content(monkeypatch: Any) -> None:
    tokenizer = _Tokenizer()
    renderer = ChatRenderer(tokenizer)
    monkeypatch.setattr(renderer, "encode", lambda text: [1])
    renderer.render(
        [{"role": "developer", "content": "d"}, {"role": "assistant", "content": None}],
        add_generation_prompt=True,
    )
    assert tokenizer.seen == [
        {"role": "system", "content": "d"},
        {"role": "assistant", "content": ""},  # None renders empty
    ]
    with pytest.raises(ApiError, match="could not find any text to continue"):
        renderer.render(
            [{"role": "assistant", "content": None}],
            add_generation_prompt=False,
            continue_final_message=True,
        )


class _CountingTokenizer:
    """A template that writes the user's text, and a tokenizer call that counts its calls."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def __init__(self) -> None:
        self.calls = 0

    def apply_chat_template(self, conversation: list[dict[str, Any]], **_: Any) -> str:
        return "".join(str(m["content"]) for m in conversation)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.calls += 1
        return {"input_ids": [ord(c) for c in text]}


def test_a_rendered_prompt_seen_before_is_not_tokenized_again() -> None:
    from aiomm.vllm.chat_template import RENDERED_TEXT_CHARS_KEPT

    tokenizer = _CountingTokenizer()
    renderer = ChatRenderer(tokenizer)
    first = renderer.render([{"role": "user", "content": "ab"}])
    assert first == [97, 98] and tokenizer.calls == 1
    first.append(0)  # a caller's list is its own
    assert renderer.render([{"role": "user", "content": "ab"}]) == [97, 98]
    assert tokenizer.calls == 1
    assert renderer.render([{"role": "user", "content": "abc"}]) == [97, 98, 99]
    assert tokenizer.calls == 2
    long = [{"role": "user", "content": "x" * (RENDERED_TEXT_CHARS_KEPT + 1)}]
    renderer.render(long)
    renderer.render(long)
    assert tokenizer.calls == 4, "a long prompt is tokenized each time, never kept"


def test_anthropic_blocks_become_vllms_chat_messages() -> None:
    image = {"type": "image", "source": {"media_type": "image/png", "data": "AAAA"}}
    parsed = parse_anthropic(
        {
            "messages": [
                {"role": "user", "content": [{"type": "thinking", "thinking": "t"}]},  # dropped
                {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm"},
                        {"type": "tool_use", "id": "t1", "name": "zoom", "input": {"x": 2}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "r"}, image],
                        }
                    ],
                },
            ]
        }
    )
    roles = [m["role"] for m in parsed.conversation]
    assert roles == ["user", "assistant", "tool", "user"]
    assistant = parsed.conversation[1]
    assert assistant["reasoning"] == "hm" and assistant["content"] is None
    assert assistant["tool_calls"][0]["function"] == {"name": "zoom", "arguments": {"x": 2}}
    assert json.dumps(parsed.conversation[2]["content"]) == '"r"'
    # the source without a type is base64, as vLLM reads it; the result's image comes after
    assert [p.url for p in parsed.images] == ["data:image/png;base64,AAAA"] * 2
    assert parsed.tool_call_count == 1


@pytest.mark.parametrize(
    "block",
    [
        {"type": "tool_addition", "tool": {"type": "tool_definition"}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "g"}},
    ],
)
def test_anthropic_tool_changes_are_refused(block: dict[str, Any]) -> None:
    body = {"messages": [{"role": "system", "content": [block]}, {"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError, match="not rendered"):
        parse_anthropic(body)
