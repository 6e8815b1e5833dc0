"""Chat-template rendering as vLLM's renderer does it: ``tokenizer.apply_chat_template`` with the
model folder's template, ``add_generation_prompt`` on by default, then the text tokenized without
special tokens added (the template writes them).

The async forms run on the event loop for ordinary prompts (a template and a tokenizer call take
well under a millisecond) and in a worker thread for long text (``LONG_TEXT_CHARS``, encoded with
the GIL released): a megabyte of prompt text takes about a second to tokenize, which on the loop
would stall every other request for as long.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from aiomm.processing.tokenize import LONG_TEXT_CHARS, encode_plain

from .errors import ApiError

__all__ = ("ChatRenderer",)


class ChatRenderer:
    """Renders conversations to token ids with a Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError("the model folder has no chat template", status=500)

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
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **dict(kwargs or {}),
            )
        except Exception as exc:  # jinja raises from inside the template on bad input
            raise ApiError(f"the chat template rejected the request: {exc}") from exc
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return encode_plain(self.tokenizer, text)

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


def _text_chars(conversation: list[dict[str, Any]]) -> int:
    total = 0
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content)
    return total
