"""Content parts of the three chat APIs -> one conversation for the chat template + media parts.

OpenAI chat (``text``, ``image_url`` and ``video_url`` with an optional per-part ``uuid``),
Responses (``input``
string or items with ``input_text`` / ``input_image`` / ``output_text``, ``instructions``) and
Anthropic messages (``text``, ``image`` with a base64 or url source, ``system``) all become the
conversation vLLM hands the template: each message's content a list of ``{"type": "text",
"text"}``, ``{"type": "image"}`` and ``{"type": "video"}`` parts in their original order, plain
strings kept as strings. As in vLLM 0.33, only chat takes ``video_url``; Responses and Anthropic
refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError

__all__ = ("ImagePart", "Parsed", "parse_anthropic", "parse_chat", "parse_responses")

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ImagePart:
    """One image or video of a request: its URL (``data:``, ``http(s):`` or ``file:``) and client
    hash."""

    url: str
    uuid: str | None = None


@dataclass
class Parsed:
    """A conversation ready for the chat template, its images and its videos in prompt order."""

    conversation: list[dict[str, Any]]
    images: list[ImagePart]
    videos: list[ImagePart] = field(default_factory=list)


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
    return role  # type: ignore[no-any-return]


def _uuid(part: dict[str, Any]) -> str | None:
    # vLLM takes any JSON value as a part's uuid and hashes with its str() (``123`` -> "123")
    uuid = part.get("uuid")
    return uuid if uuid is None or isinstance(uuid, str) else str(uuid)


def _text(block: Any, where: str, param: str = "input") -> str:
    _need(isinstance(block, dict), f"{where} must be an object", param)
    text = block.get("text")
    _need(isinstance(text, str), f"{where}.text must be a string", param)
    return text  # type: ignore[no-any-return]


def parse_chat(body: dict[str, Any]) -> Parsed:
    """An OpenAI chat-completions body.

    :raises ApiError: malformed messages or an unsupported content part.
    """
    images: list[ImagePart] = []
    videos: list[ImagePart] = []
    conversation: list[dict[str, Any]] = []
    for i, message in enumerate(_messages(body)):
        role = _role(message, i)
        content = message.get("content")
        if content is None or isinstance(content, str):
            conversation.append({"role": role, "content": content or ""})
            continue
        _need(isinstance(content, list), f"messages[{i}].content must be a string or a list")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            _need(isinstance(part, dict), f"{where} must be an object", "messages")
            kind = part.get("type")
            if kind == "text":
                _need(isinstance(part.get("text"), str), f"{where}.text must be a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image_url", "video_url"):
                spec = part.get(kind)
                url = spec.get("url") if isinstance(spec, dict) else spec
                _need(isinstance(url, str) and bool(url), f"{where}.{kind}.url is missing")
                (images if kind == "image_url" else videos).append(ImagePart(url, _uuid(part)))
                parts.append({"type": "image" if kind == "image_url" else "video"})
            else:
                raise ApiError(f"{where}: unsupported content part type {kind!r}", param="messages")
        conversation.append({"role": role, "content": parts})
    return Parsed(conversation, images, videos)


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
        conversation.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        conversation.append({"role": "user", "content": raw})
        return Parsed(conversation, images)
    _need(isinstance(raw, list) and bool(raw), "'input' must be a string or a non-empty list")
    for i, item in enumerate(raw):
        role = _role(item, i)
        content = item.get("content")
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
    return Parsed(conversation, images)


def parse_anthropic(body: dict[str, Any]) -> Parsed:
    """An Anthropic messages body.

    :raises ApiError: malformed messages or an unsupported block.
    """
    conversation: list[dict[str, Any]] = []
    images: list[ImagePart] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(_text(b, f"system[{k}]", "system") for k, b in enumerate(system))
    _need(
        system is None or isinstance(system, str), "'system' must be a string or a list", "system"
    )
    if system:
        conversation.append({"role": "system", "content": system})
    for i, message in enumerate(_messages(body)):
        role = _role(message, i)
        content = message.get("content")
        if isinstance(content, str):
            conversation.append({"role": role, "content": content})
            continue
        _need(isinstance(content, list), f"messages[{i}].content must be a string or a list")
        parts: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append({"type": "text", "text": _text(block, where, "messages")})
            elif kind == "image":
                source = block.get("source")
                _need(isinstance(source, dict), f"{where}.source must be an object", "messages")
                if source.get("type") == "base64":
                    mime = source.get("media_type", "image/jpeg")
                    url = f"data:{mime};base64,{source.get('data', '')}"
                elif source.get("type") == "url":
                    url = str(source.get("url", ""))
                else:
                    raise ApiError(f"messages[{i}].content[{j}].source: unsupported image source")
                images.append(ImagePart(url))
                parts.append({"type": "image"})
            else:
                raise ApiError(f"messages[{i}].content[{j}]: unsupported block type {kind!r}")
        conversation.append({"role": role, "content": parts})
    return Parsed(conversation, images)
