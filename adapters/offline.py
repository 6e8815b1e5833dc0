"""Reference HF processors built offline: tokenizers in code, processors from documented params.

No model hub is reachable in CI or in air-gapped deployments, so tests, the CLI's embedded
defaults and the benchmarks construct each architecture's HF processor here: a small word-level
tokenizer (the ``tokenizers`` library) carrying the model's real special tokens, and image
processors from their defaults or the parameters the model's published config documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ("PROMPT_WORDS", "build_tokenizer")

#: Plain words the offline tokenizers know (anything else maps to the unknown token).
PROMPT_WORDS: tuple[str, ...] = (
    "describe", "the", "image", "images", "and", "compare", "what", "is", "in", "this", "picture",
    "a", "photo", "of", "user", "assistant", "system", "please", "first", "second", "third",
    "fourth", "look", "at", "tell", "me", "about", "detail", "colours", "shapes", "\n",
)  # fmt: skip


def build_tokenizer(
    special_tokens: Sequence[str], *, eos_token: str, unk_token: str = "<unk>"
) -> Any:
    """A word-level fast tokenizer with ``special_tokens`` added as atomic special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {unk_token: 0, **{w: i + 1 for i, w in enumerate(PROMPT_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = list(dict.fromkeys([eos_token, *special_tokens]))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk_token, eos_token=eos_token)
