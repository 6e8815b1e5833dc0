"""Chat-template rendering as vLLM's renderer does it: ``tokenizer.apply_chat_template`` with the
model folder's template, ``add_generation_prompt`` on by default, then the text tokenized without
special tokens added (the template writes them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiomm.processing.tokenize import encode_plain

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
