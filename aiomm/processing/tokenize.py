"""Text to token ids without special tokens, as a Hugging Face tokenizer gives them, taking its
fast backend directly when that gives the same ids (the wrapper's bookkeeping costs twice the
encoding of a short prompt, on the event loop). Long text goes through ``encode_batch``, which
releases the GIL where ``encode`` holds it (a megabyte of text takes about a second: on a worker
thread, the event loop keeps running)."""

from __future__ import annotations

from typing import Any

__all__ = ("LONG_TEXT_CHARS", "encode_plain", "plain_backend")

#: text of more characters is long: encoded with the GIL released, and worth a worker thread
LONG_TEXT_CHARS = 1 << 14


def plain_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind an HF fast tokenizer when calling it directly gives
    the wrapper's ids (no truncation, padding or special-token splitting left switched on);
    else None."""
    # asked of the class: a stand-in that builds the real tokenizer on unknown attributes (the
    # stored snapshots) encodes directly already and must not be made to build it
    if not isinstance(getattr(type(tokenizer), "backend_tokenizer", None), property):
        return None
    backend = tokenizer.backend_tokenizer
    if not hasattr(backend, "encode"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(backend.encode_special_tokens) != bool(
        getattr(tokenizer, "split_special_tokens", False)
    ):
        return None
    return backend


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer(text, add_special_tokens=False)``'s ids (through the backend when
    :func:`plain_backend` allows)."""
    backend = plain_backend(tokenizer)
    if backend is not None:
        if len(text) > LONG_TEXT_CHARS:  # the same ids, without the GIL
            return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
