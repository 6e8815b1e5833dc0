"""Content parts of the three chat APIs -> one conversation for the chat template + media parts.

OpenAI chat (``text``, ``image_url``, ``video_url``, ``audio_url`` and ``input_audio`` with an
optional per-part ``uuid``), Responses (``input``
string or items with ``input_text`` / ``input_image`` / ``output_text``, ``instructions``,
``function_call`` / ``function_call_output`` / ``reasoning`` items) and
Anthropic messages (``text``, ``image`` with a base64 or url source, ``system``, tool and thinking
blocks, converted to chat messages first as vLLM converts them) all become the conversation vLLM
hands the template: each message's content a list of ``{"type": "text", "text"}``,
``{"type": "image"}``, ``{"type": "video"}`` and ``{"type": "audio"}`` parts in their original
order, plain strings kept as strings, a missing content None. System texts lose Claude Code's
billing header line, as vLLM's chat parser drops it. As in vLLM 0.33, only chat takes videos and
audio; Responses and Anthropic refuse them. An ``input_audio`` part's ``{"data", "format"}``
becomes the data URL vLLM makes of it, ``data:audio/<format>;base64,<data>`` (the format names
only the MIME subtype: the bytes decide how the clip is decoded).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiomm.vllm.errors import ApiError

__all__ = (
    "ImagePart",
    "Parsed",
    "is_base64_header",
    "media_url",
    "parse_anthropic",
    "parse_chat",
    "parse_responses",
)

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def is_base64_header(header: str) -> bool:
    """Whether a data URL's header (between ``data:`` and the comma) ends in ``;base64``."""
    return header.rsplit(";", 1)[-1].strip().lower() == "base64"


def media_url(url: str) -> str:
    """``url`` as a media part's URL, checked as vLLM checks it: a ``data:`` URL must be
    ``data:<mime>;base64,<payload>`` (vLLM refuses the percent-encoded form).

    :raises ApiError: 400 for a data URL without a comma, 501 for one that is not base64
        (vLLM's words and statuses).
    """
    if url[:5].lower() == "data:":
        comma = url.find(",", 5)
        if comma < 0:
            raise ApiError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
        if not is_base64_header(url[5:comma]):
            raise ApiError(
                "Only base64 data URLs are supported for now.",
                status=501,
                type="NotImplementedError",
            )
    return url


@dataclass(frozen=True)
class ImagePart:
    """One image, video or audio clip of a request: its URL (``data:``, ``http(s):`` or ``file:``)
    and client hash."""

    url: str
    uuid: str | None = None
    #: a data URL's bytes, decoded while the body was read (:mod:`aiomm.server.data_urls`)
    data: bytes | None = field(default=None, repr=False, compare=False)


@dataclass
class Parsed:
    """A conversation ready for the chat template, its images, videos and audio clips in prompt
    order."""

    conversation: list[dict[str, Any]]
    images: list[ImagePart]
    videos: list[ImagePart] = field(default_factory=list)
    audios: list[ImagePart] = field(default_factory=list)
    #: its last message is to be continued, not answered (a Responses item in progress)
    continue_final: bool = False

    @property
    def tool_call_count(self) -> int:
        """The tool calls of its assistant messages (vLLM's ``history_tool_call_cnt``)."""
        return sum(
            len(m.get("tool_calls", ())) for m in self.conversation if m["role"] == "assistant"
        )


def _need(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise ApiError(message, param=param)


def _messages(body: dict[str, Any], key: str = "messages") -> list[Any]:
    messages = body.get(key)
    _need(isinstance(messages, list) and bool(messages), f"'{key}' must be a non-empty list", key)
    return messages  # type: ignore[return-value]


def _role(message: Any, i: int) -> str:
    _need(isinstance(message, dict), f"messages[{i}] must be an object", "messages")
    role = message.get("role")
    _need(
        isinstance(role, str) and role in _ROLES,
        f"messages[{i}].role must be one of {sorted(_ROLES)}",
        "messages",
    )
    return role


def _uuid(part: dict[str, Any]) -> str | None:
    # vLLM takes any JSON value as a part's uuid and hashes with its str() (``123`` -> "123")
    uuid = part.get("uuid")
    return uuid if uuid is None or isinstance(uuid, str) else str(uuid)


def _text(block: Any, where: str, param: str = "input") -> str:
    _need(isinstance(block, dict), f"{where} must be an object", param)
    text = block.get("text")
    _need(isinstance(text, str), f"{where}.text must be a string", param)
    return text


def parse_chat(body: dict[str, Any]) -> Parsed:
    """An OpenAI chat-completions body.

    :raises ApiError: malformed messages or an unsupported content part.
    """
    media: dict[str, list[ImagePart]] = {"image": [], "video": [], "audio": []}
    conversation: list[dict[str, Any]] = []
    for i, message in enumerate(_messages(body)):
        role = _role(message, i)
        content = message.get("content")
        # vLLM's message types allow an explicit null only for assistant and function messages
        _need(
            content is not None or "content" not in message or role in ("assistant", "function"),
            f"messages[{i}].content: Input should be a valid string or list",
            "messages",
        )
        # checked after the parts, whose own errors say more (vLLM refuses either way)
        weak = (
            role in _OPENAI_ROLES
            and isinstance(content, list)
            and bool(content)
            and not any(_declared(part) for part in content)
        )
        if role == "system":
            content = _without_billing_header(content)
        if content is None or isinstance(content, str):
            _need(not weak, f"messages[{i}].content: no part is one of the part types", "messages")
            # None stays None: no text to continue (the renderer shows it empty)
            conversation.append(_message_fields(message, i, role, content))
            continue
        _need(isinstance(content, list), f"messages[{i}].content must be a string or a list")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind, value = _chat_part(part, where)
            if kind == "text":
                parts.append({"type": "text", "text": value})
            elif kind is not None:
                if value is None:  # an audio part without a clip: vLLM's words
                    n = len(media[kind])
                    raise ApiError(
                        f"multi_modal_data['{kind}'][{n}] is empty but "
                        f"multi_modal_uuids['{kind}'][{n}] is missing."
                        if part.get("uuid") is None
                        else f"multi_modal_data['{kind}'][{n}] is empty: a uuid alone names no "
                        "clip (this server keeps no items by client ids)",
                        param="multi_modal_uuids",
                    )
                media[kind].append(ImagePart(value, _uuid(part)))
                parts.append({"type": kind})
        _need(not weak, f"messages[{i}].content: no part is one of the part types", "messages")
        conversation.append(_message_fields(message, i, role, parts))
    return Parsed(conversation, media["image"], media["video"], media["audio"])


def _message_fields(message: dict[str, Any], i: int, role: str, content: Any) -> dict[str, Any]:
    """The template's message: ``content`` and what vLLM's chat parser passes on beside it (an
    assistant's tool calls, arguments as objects, and reasoning; a tool message's call id, its
    text parts joined by newlines; ``name``)."""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            _need(isinstance(calls, list), f"messages[{i}].tool_calls must be a list", "tool_calls")
            if calls:
                out["tool_calls"] = [_tool_call(call, i) for call in calls]
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(content, list) and all(p["type"] == "text" for p in content):
            out["content"] = "\n".join(p["text"] for p in content)
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _tool_call(call: Any, i: int) -> dict[str, Any]:
    """One of an assistant's tool calls as vLLM's ``_postprocess_messages`` hands it to the
    template: its arguments an object (``{}`` when missing or not a JSON object)."""
    _need(isinstance(call, dict), "assistant tool_calls entries must be objects.", "tool_calls")
    function = call.get("function")
    _need(
        call.get("type", "function") == "function" and isinstance(function, dict),
        "chat completions only support assistant tool_calls of type 'function'.",
        "tool_calls",
    )
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}  # vLLM keeps such a conversation going with an empty object
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


#: the part types vLLM's chat parser reads as text, and the key holding each one's text
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: the ``detail`` values of an image or video URL (vLLM's literal)
_DETAILS = frozenset({"auto", "low", "high", "original"})
#: media part types and the modality of each
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}
#: the keys that make a part with a ``uuid`` or no ``type`` media, in the order vLLM tries them
_MEDIA_KEYS = ("image_url", "audio_url", "input_audio", "video_url")


def _chat_part(part: Any, where: str) -> tuple[str | None, Any]:
    """``("text", text)``, ``("image" | "video" | "audio", url)`` or ``(None, None)`` (a part
    vLLM skips) of one chat content part, read as vLLM's ``parse_chat_message_content_mm_part``
    reads it: a part with a ``uuid`` or no ``type`` is media found by its key.

    :raises ApiError: a part of another type, or without the text or URL its type names.
    """
    if isinstance(part, str):
        return "text", part
    _need(isinstance(part, dict), f"{where} must be an object", "messages")
    kind = part.get("type")
    if kind in _TEXT_PARTS and part.get("uuid") is None:
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in ("text", "refusal"):
            return None, None  # skipped, as vLLM skips them
        _need(isinstance(text, str), f"{where}.{_TEXT_PARTS[kind]} must be a string")
        return "text", text
    by_key = kind is None or part.get("uuid") is not None
    if by_key:
        key = next((k for k in _MEDIA_KEYS if k in part), None)
        _need(key is not None, "Missing 'type' field in multimodal part.", "type")
        kind = key
    elif kind not in _MEDIA_PARTS:
        raise ApiError(f"{where}: unsupported content part type {kind!r}", param="messages")
    elif kind == "input_image":  # in a chat message, vLLM validates it as a Responses part
        _need("detail" in part, f"{where}.detail: Field required", "messages")
    if kind == "input_audio":
        return "audio", _input_audio_url(part.get("input_audio"), where)
    key = "image_url" if kind == "input_image" else kind  # a Responses part's URL key
    spec = part.get(key)
    if not by_key and kind != "input_image":  # a typed part, as pydantic reads it
        _need(isinstance(spec, dict), f"{where}.{key}: Input should be a valid dictionary")
        # an audio URL has no detail (vLLM's AudioURL)
        _need(
            kind == "audio_url" or spec.get("detail", "auto") in _DETAILS,
            f"{where}.{key}.detail: Input should be 'auto', 'low', 'high' or 'original'",
        )
        _need("url" in spec, f"{where}.{key}.url is missing")
        _need(isinstance(spec["url"], str), f"{where}.{key}.url: Input should be a valid string")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if _MEDIA_PARTS[kind] == "audio" and (url is None or url == ""):
        return "audio", None  # vLLM's parser takes it, and its processor then refuses it
    _need(isinstance(url, str) and bool(url), f"{where}.{key}.url is missing")
    return _MEDIA_PARTS[kind], url


#: the roles whose OpenAI message type vLLM's request validation prefers, when no part of a
#: message's content list sets a field of vLLM's own content part types: its parts are then
#: validated lazily as OpenAI's (text, image_url, input_audio of wav or mp3, file), and a part
#: that is none of those fails the request
_OPENAI_ROLES = frozenset({"user", "system", "assistant", "developer"})


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _str_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _url_spec(value: Any, details: frozenset[str] | None = None) -> bool:
    return (
        isinstance(value, dict)
        and _is_str(value.get("url"))
        and (details is None or value.get("detail", "auto") in details)
    )


def _embeds(key: str) -> Callable[[dict[str, Any]], bool]:
    def test(part: dict[str, Any]) -> bool:
        return _str_or_none(part.get("uuid")) and (
            part.get(key) is None or isinstance(part[key], (str, dict))
        )

    return test


#: vLLM's typed content parts: the test of a part of each type against its TypedDict
_TYPED_PARTS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "text": lambda p: _is_str(p.get("text")),
    "refusal": lambda p: _is_str(p.get("refusal")),
    "thinking": lambda p: _is_str(p.get("thinking")) and isinstance(p.get("closed", True), bool),
    "image_url": lambda p: _url_spec(p.get("image_url"), _DETAILS),
    "audio_url": lambda p: _url_spec(p.get("audio_url")),
    "video_url": lambda p: _url_spec(p.get("video_url")),
    "input_audio": lambda p: (
        isinstance(a := p.get("input_audio"), dict)
        and _is_str(a.get("data"))
        and a.get("format") in ("wav", "mp3")
    ),
    "file": lambda p: (
        isinstance(f := p.get("file"), dict)
        and all(_is_str(f[k]) for k in ("file_data", "file_id", "filename") if k in f)
    ),
    "prompt_embeds": lambda p: _is_str(p.get("data")),
    "image_embeds": _embeds("image_embeds"),
    "audio_embeds": _embeds("audio_embeds"),
    "video_embeds": _embeds("video_embeds"),
}
#: vLLM's content part types without a required field: the test of each of their fields
_OPEN_PARTS: tuple[dict[str, Callable[[Any], bool]], ...] = (
    {"image_url": _str_or_none, "uuid": _str_or_none},
    {"image_pil": lambda v: v is None, "uuid": _str_or_none},
    {"audio_url": _str_or_none},
    {"video_url": _str_or_none, "uuid": _str_or_none},
    {"name": _is_str, "type": lambda v: v == "tool_reference"},
)


def _declared(part: Any) -> bool:
    """Whether ``part`` validates as one of vLLM's content part types with a field set (which
    makes pydantic keep the message as vLLM's type, whatever its other parts are)."""
    if not isinstance(part, dict):
        return False
    test = _TYPED_PARTS.get(part.get("type"))  # type: ignore[arg-type]
    if test is not None and test(part):
        return True
    return any(
        any(k in part for k in fields) and all(ok(part[k]) for k, ok in fields.items() if k in part)
        for fields in _OPEN_PARTS
    )


def _input_audio_url(spec: Any, where: str) -> str | None:
    """The data URL vLLM's parser makes of an ``input_audio`` part's ``{"data", "format"}``:
    ``data:audio/<format>;base64,<data>``, whatever the format says (None without data).

    :raises ApiError: a clip that is not an object (vLLM answers 500: it calls its ``get``), or
        data that is not a string.
    """
    _need(not spec or isinstance(spec, dict), f"{where}.input_audio must be an object")
    data = spec.get("data") if spec else None
    if not data:
        return None
    _need(isinstance(data, str), f"{where}.input_audio.data must be a base64 string")
    return f"data:audio/{spec.get('format', '')};base64,{data}"


def _without_billing_header(content: Any) -> Any:
    """A system message's content without Claude Code's billing header line, as vLLM's chat
    parser strips it from each text (a text that is only the header is dropped)."""
    if isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        return content
    out = []
    for part in content:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    if len(out) == 1 and isinstance(out[0], str):
        return out[0]
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in out]


def parse_responses(body: dict[str, Any]) -> Parsed:
    """An OpenAI Responses body (stateless: ``previous_response_id`` is refused).

    :raises ApiError: malformed input or an unsupported item.
    """
    _need(
        body.get("previous_response_id") is None,
        "previous_response_id is not supported by a stateless render server",
        "previous_response_id",
    )
    conversation: list[dict[str, Any]] = []
    images: list[ImagePart] = []
    instructions = body.get("instructions")
    _need(
        instructions is None or isinstance(instructions, str),
        "'instructions' must be a string",
        "instructions",
    )
    if instructions:  # vLLM leaves an empty one out (the template's default system prompt)
        conversation.append({"role": "system", "content": _without_billing_header(instructions)})
    raw = body.get("input")
    if isinstance(raw, str):
        conversation.append({"role": "user", "content": raw})
        return Parsed(conversation, images)
    _need(isinstance(raw, list) and bool(raw), "'input' must be a string or a non-empty list")
    assert isinstance(raw, list)  # _need raised otherwise
    first_input = len(conversation)  # items merge into the assistant message before them
    for i, item in enumerate(raw):
        if isinstance(item, dict) and item.get("type") in _TOOL_ITEMS:
            prev = conversation[-1] if len(conversation) > first_input else None
            message = _tool_item(item, i, prev if prev and prev["role"] == "assistant" else None)
            if message is not None:
                conversation.append(message)
            continue
        role = _role(item, i)
        content = item.get("content")
        if role == "assistant" and isinstance(content, list) and content:
            # vLLM's _construct_message_from_response_item keeps an assistant item's first text
            first = content[0].get("text") if isinstance(content[0], dict) else None
            content = first if isinstance(first, str) else content
        if role == "assistant" and isinstance(content, str) and len(conversation) > first_input:
            prev = conversation[-1]
            if prev["role"] == "assistant" and prev["content"] is None:
                prev["content"] = content  # the text of a turn its calls or reasoning began
                continue
        if role == "system":
            content = _without_billing_header(content)
        if isinstance(content, str):
            conversation.append({"role": role, "content": content})
            continue
        _need(isinstance(content, list), f"input[{i}].content must be a string or a list")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text"):
                parts.append({"type": "text", "text": _text(part, f"input[{i}].content[{j}]")})
            elif kind == "input_image":
                url = part.get("image_url")
                _need(
                    isinstance(url, str) and bool(url),
                    f"input[{i}].content[{j}].image_url must be a URL string",
                )
                images.append(ImagePart(url, _uuid(part)))
                parts.append({"type": "image"})
            else:
                raise ApiError(f"input[{i}].content[{j}]: unsupported type {kind!r}", param="input")
        conversation.append({"role": role, "content": parts})
    last = raw[-1]
    # vLLM's should_continue_final_message: a last message (or reasoning) item in progress
    continue_final = last.get("type", "message") in ("message", "reasoning") and last.get(
        "status"
    ) in ("in_progress", "incomplete")
    return Parsed(conversation, images, continue_final=continue_final)


#: the Responses items that are not messages, which vLLM turns into chat messages
_TOOL_ITEMS = frozenset({"function_call", "function_call_output", "reasoning"})


def _tool_item(item: dict[str, Any], i: int, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message of a Responses ``function_call``, ``function_call_output`` or
    ``reasoning`` item, as vLLM's ``_construct_message_from_response_item`` makes it; None when
    it joins ``prev``, the assistant message before it (a call to its calls, reasoning to one
    without).

    :raises ApiError: an item without the fields its type requires, or encrypted reasoning.
    """
    kind = item["type"]

    def field(name: str) -> str:
        value = item.get(name)
        _need(isinstance(value, str), f"input[{i}].{name}: Input should be a valid string", "input")
        return value  # type: ignore[return-value]

    if kind == "function_call_output":
        return {"role": "tool", "content": field("output"), "tool_call_id": field("call_id")}
    if kind == "function_call":
        call = {
            "id": field("call_id"),
            "type": "function",
            "function": {"name": field("name"), "arguments": field("arguments")},
        }
        call = _tool_call(call, i)
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    _need(not item.get("encrypted_content"), "Encrypted content is not supported.", "input")
    texts = item.get("content") or item.get("summary") or [{}]
    reasoning = texts[0].get("text", "") if isinstance(texts[0], dict) else ""
    if prev is not None and "reasoning" not in prev:
        prev["reasoning"] = prev["reasoning_content"] = reasoning
        return None
    return {
        "role": "assistant",
        "content": None,
        "reasoning": reasoning,
        "reasoning_content": reasoning,
    }


#: the roles of Anthropic's messages (vLLM's ``AnthropicMessage``)
_ANTHROPIC_ROLES = ("user", "assistant", "system")
#: Anthropic's block types (vLLM's ``AnthropicContentBlock``); the last three name or change
#: tools, which aiomm does not render (refused)
_ANTHROPIC_BLOCKS = frozenset(
    {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}
    | {"tool_reference", "tool_addition", "tool_removal"}
)
#: the line Claude Code puts first in its system prompt (a per-request hash: vLLM drops it)
BILLING_HEADER = "x-anthropic-billing-header"


def parse_anthropic(body: dict[str, Any], *, merge_inline_system: bool = False) -> Parsed:
    """An Anthropic messages body, converted to OpenAI chat messages as vLLM's
    ``AnthropicServingMessages.to_chat_completion_request`` converts it, then parsed as chat:
    the top-level ``system`` (text blocks joined, empty ones and Claude Code's billing header
    block left out) first; a user message with nothing left is dropped; ``tool_use`` blocks
    become the assistant's ``tool_calls``, a user's ``tool_result`` a ``tool`` message (its
    images a user message after it); thinking blocks show nothing. ``merge_inline_system``: the
    template wants one system message first, so inline ones join the top-level one.

    :raises ApiError: malformed messages or an unknown block type.
    """
    messages = _messages(body)
    system_parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        system_parts += [system] if system else []
    elif isinstance(system, list):
        system_parts += _system_texts(system, "system", "system")
    else:
        _need(system is None, "'system' must be a string or a list", "system")
    for i, message in enumerate(messages):
        _anthropic_role(message, i)
    if merge_inline_system:
        for i, message in enumerate(messages):
            if message["role"] == "system" and (text := _inline_system(message, i)):
                system_parts.append(text)
    chat: list[dict[str, Any]] = []
    if system_parts:
        chat.append({"role": "system", "content": "".join(system_parts)})
    for i, message in enumerate(messages):
        role = message["role"]
        content = message.get("content")
        if role == "system":
            if not merge_inline_system and (text := _inline_system(message, i)):
                chat.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        _need(isinstance(content, list), f"messages[{i}].content must be a string or a list")
        converted = _anthropic_blocks(content, role, i, chat)
        if role != "user" or "content" in converted:  # vLLM drops a user turn without content
            chat.append({"role": role, **converted})
    if not chat:  # vLLM's words
        raise ApiError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    return parse_chat({"messages": chat})


def _anthropic_role(message: Any, i: int) -> str:
    _need(isinstance(message, dict), f"messages[{i}] must be an object", "messages")
    role = message.get("role")
    _need(
        role in _ANTHROPIC_ROLES,
        f"messages[{i}].role: Input should be 'user', 'assistant' or 'system'",
        "messages",
    )
    return role


def _block_type(block: Any, where: str, param: str = "messages") -> str:
    _need(isinstance(block, dict), f"{where} must be an object", param)
    kind = block.get("type")
    _need(kind in _ANTHROPIC_BLOCKS, f"{where}: unsupported block type {kind!r}", param)
    return kind


def _block_text(block: dict[str, Any], where: str, param: str = "messages") -> str | None:
    text = block.get("text")
    _need(text is None or isinstance(text, str), f"{where}.text must be a string", param)
    return text


def _system_texts(blocks: list[Any], where: str, param: str = "messages") -> list[str]:
    """The texts of system blocks: non-empty text blocks but Claude Code's billing header."""
    texts = []
    for k, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{k}]", param)
        if kind in ("tool_addition", "tool_removal"):  # they change the tools, never rendered
            raise ApiError(f"{where}[{k}]: {kind} blocks are not rendered", param=param)
        text = _block_text(block, f"{where}[{k}]", param)
        if kind == "text" and text and not text.startswith(BILLING_HEADER):
            texts.append(text)
    return texts


def _inline_system(message: dict[str, Any], i: int) -> str | None:
    """The text of a system message inside ``messages`` (vLLM's ``_extract_system_text``)."""
    content = message.get("content")
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    _need(isinstance(content, list), f"messages[{i}].content must be a string or a list")
    assert isinstance(content, list)  # _need raised otherwise
    return "".join(_system_texts(content, f"messages[{i}].content")) or None


def _image_source_url(source: dict[str, Any]) -> str:
    # vLLM's _convert_image_source_to_url: a source that is not a url one is base64
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _anthropic_blocks(
    blocks: list[Any], role: str, i: int, chat: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat fields (``content``, ``tool_calls``, ``reasoning``) of one message's blocks,
    empty when they carry nothing; a user's tool results are appended to ``chat`` as they come.
    """
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = _block_type(block, where)
        if kind == "text":
            if text := _block_text(block, where):
                parts.append({"type": "text", "text": text})
        elif kind == "image":
            source = block.get("source")
            _need(
                source is None or isinstance(source, dict),
                f"{where}.source must be an object",
                "messages",
            )
            if source:
                parts.append({"type": "image_url", "image_url": {"url": _image_source_url(source)}})
        elif kind == "thinking" and block.get("thinking") is not None:
            thoughts.append(str(block["thinking"]))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or "call",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            result = block.get("content")
            if role == "user":
                chat += _user_tool_result(result)
            else:
                shown = str(result) if result else ""
                parts.append({"type": "text", "text": f"Tool result: {shown}"})
        elif kind in ("tool_addition", "tool_removal"):
            raise ApiError(
                f'{kind} blocks are only allowed in messages with role "system"', param="messages"
            )
        elif kind == "tool_reference":
            raise ApiError(f"{where}: tool references are not rendered", param="messages")
    out: dict[str, Any] = {}
    if thoughts:
        out["reasoning"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    if parts:
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        out["content"] = parts[0]["text"] if one_text else parts
    return out


def _user_tool_result(result: Any) -> list[dict[str, Any]]:
    """A user's ``tool_result`` as vLLM's ``_convert_user_tool_result`` writes it: a ``tool``
    message of its texts joined by newlines, then a user message of its images."""
    text, urls = "", []
    if isinstance(result, str):
        text = result
    elif isinstance(result, list):
        texts = []
        for item in result:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image" and (
                url := _image_source_url(item.get("source") or {})
            ):
                urls.append(url)
            elif item.get("type") == "tool_reference":
                raise ApiError(
                    "tool references in a tool_result are not rendered", param="messages"
                )
        text = "\n".join(texts)
    out: list[dict[str, Any]] = [{"role": "tool", "content": text}]
    if urls:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls],
            }
        )
    return out
