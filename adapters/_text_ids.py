"""Token ids of the short texts a prompt update writes (frame timestamps), tokenized once each.

A video's prompt carries a timestamp text per temporal patch; the same few texts recur across
requests, so each is tokenized once and kept. HF fast tokenizers are not thread-safe, and prompt
updates run in worker threads: one lock guards the tokenizer.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ("TextIds",)

#: texts kept at most (a timestamp per tenth of a second of 1.8 hours)
_MAX_TEXTS = 65536


class TextIds:
    """``text -> token ids`` of ``tokenizer`` without special tokens, as HF tokenizes the text
    between two special tokens of a processor's expanded prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._ids.get(text)
        if ids is None:
            with self._lock:
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if len(self._ids) >= _MAX_TEXTS:  # hours of video: bounded, not an LRU
                    self._ids.clear()
                self._ids[text] = ids
        return ids
