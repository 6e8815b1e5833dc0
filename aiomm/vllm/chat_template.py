"""Chat-template rendering as vLLM's renderer does it: ``tokenizer.apply_chat_template`` with the
model folder's template, ``add_generation_prompt`` on by default, then the text tokenized without
special tokens added (the template writes them).

The async forms run on the event loop for ordinary prompts (a template and a tokenizer call take
well under a millisecond) and in a worker thread for long text (``LONG_TEXT_CHARS``, encoded with
the GIL released): a megabyte of prompt text takes about a second to tokenize, which on the loop
would stall every other request for as long. A short rendered prompt's token ids are kept
(``RENDERED_TEXTS_KEPT``): requests of one shape render the same text, and its tokenizer call
costs more than the template's render.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import jinja2
import jinja2.ext
import jinja2.sandbox

from aiomm.processing.tokenize import LONG_TEXT_CHARS, encode_plain
from aiomm.vllm.errors import ApiError

__all__ = ("ChatRenderer",)

#: rendered prompts whose token ids a renderer keeps (requests of one shape render the same text:
#: the template writes each image as its placeholder, never its URL)
RENDERED_TEXTS_KEPT = 256
#: longer rendered prompts are tokenized each time (hashing them would cost what it saves)
RENDERED_TEXT_CHARS_KEPT = 4096


class ChatRenderer:
    """Renders conversations to token ids with a Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if template is None:
            raise ApiError("the model folder has no chat template", status=500)
        # vLLM's test: a template that names the role (quoted) renders developer messages
        self._template_has_developer = any(
            '"developer"' in t or "'developer'" in t for t in _template_texts(template)
        )
        # per renderer: its tokenizer's ids (thread-safe; a tuple, so no caller can change it)
        self._rendered_ids = functools.lru_cache(maxsize=RENDERED_TEXTS_KEPT)(self._encode_tuple)

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``conversation``.

        :raises ApiError: the template rejected the conversation.
        """
        if not self._template_has_developer and any(
            m.get("role") == "developer" for m in conversation
        ):
            conversation = _developer_as_system(conversation)
        if continue_final_message and not _has_text_part(conversation[-1].get("content")):
            raise ApiError(
                "continue_final_message is set but we could not find any text to continue in "
                "the final message!"
            )  # transformers' words, as vLLM answers
        # vLLM's parser turns a missing content into no parts, which templates show as empty
        conversation = [
            {**m, "content": ""} if m.get("content") is None else m for m in conversation
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **dict(kwargs or {}),
            )
        except Exception as exc:  # jinja raises from inside the template on bad input
            raise ApiError(_template_error_reason(exc)) from exc  # vLLM's words: the reason
        if len(text) > RENDERED_TEXT_CHARS_KEPT:
            return self.encode(text)
        # a short prompt's tokenizer call costs more than the template's render (~70 us)
        return list(self._rendered_ids(text))

    @functools.cached_property
    def merges_inline_system(self) -> bool:
        """Whether the template wants its system message first, as vLLM's Anthropic API probes
        it: rendering ``[system, user, system, user]`` raises (Qwen's ``loop.first`` guard)."""
        return any(_rejects_inline_system(t) for t in _template_texts(self.tokenizer.chat_template))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return encode_plain(self.tokenizer, text)

    def _encode_tuple(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text))

    async def arender(self, conversation: list[dict[str, Any]], **options: Any) -> list[int]:
        """:meth:`render` (the same keyword options), in a worker thread when the
        conversation's text is long."""
        call = functools.partial(self.render, conversation, **options)
        if _text_chars(conversation) <= LONG_TEXT_CHARS:
            return call()
        return await anyio.to_thread.run_sync(call)

    async def aencode(self, text: str) -> list[int]:
        """:meth:`encode`, in a worker thread when ``text`` is long."""
        return (await self.aencode_all([text]))[0]

    async def aencode_all(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in one worker thread when their total is long (a batch
        of texts each below the bound would otherwise hold the event loop for all of them)."""
        if sum(len(t) for t in texts) <= LONG_TEXT_CHARS:
            return [self.encode(t) for t in texts]
        return await anyio.to_thread.run_sync(lambda: [self.encode(t) for t in texts])


def _template_texts(template: str | dict[str, str]) -> list[str]:
    """The text of a tokenizer's chat template, or of each of its named ones."""
    texts = template.values() if isinstance(template, dict) else (template,)
    return [t for t in texts if isinstance(t, str)]


def _template_error_reason(exc: BaseException) -> str:
    """The most specific reason in a template error's chain (a jinja error's own message), as
    vLLM reports it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


def _rejects_inline_system(template: str) -> bool:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        environment.from_string(template).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``developer`` messages as ``system`` ones, for a template that does not know the role, as
    vLLM's ``safe_apply_chat_template`` rewrites them: when the conversation then has a system
    message after its first or more than one, all of them become one at its start, their texts
    joined by blank lines (a message's text parts by newlines; empty texts and other parts
    dropped)."""
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(conversation):
        if message.get("role") not in ("system", "developer"):
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part if isinstance(part, str) else part["text"]
                for part in content
                if isinstance(part, str) or (isinstance(part, dict) and "text" in part)
            )
        if content:
            texts.append(content)
    if not merge:
        return [
            {**m, "role": "system"} if m.get("role") == "developer" else m for m in conversation
        ]
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def _has_text_part(content: Any) -> bool:
    """Whether transformers finds text to continue: a string (even empty) or a text part."""
    if isinstance(content, list):
        return any(isinstance(p, dict) and "text" in p for p in content)
    return isinstance(content, str)


def _text_chars(conversation: list[dict[str, Any]]) -> int:
    total = 0
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content)
    return total
