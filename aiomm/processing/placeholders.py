"""Where each multimodal item's tokens sit in a prompt: ranges, and the scan that finds them.

:func:`find_placeholders` scans the prompt left to right, as vLLM does: at each position it tries
the next unfound item of every modality (modalities in priority order, an item's alternative
contents in order) and takes the first whose full content starts there; it then jumps past that
content. An item that is never found blocks every later item of its modality.

The scan never compares token by token at every position: each candidate content has a
:class:`TokenSearcher` (Knuth-Morris-Pratt, forward only), so the whole scan reads each prompt
token a bounded number of times per candidate and stays linear on adversarial prompts.

This module knows nothing of prompt updates (:mod:`aiomm.processing.prompt_updates` builds on it):
a content is anything with token ids ``full`` and a mask ``is_embed`` (:class:`PlaceholderContent`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

__all__ = ("PlaceholderContent", "PlaceholderRange", "TokenSearcher", "find_placeholders")

# First chunk compared slice-wise after a token that can start a match; chunks then double.
_FIRST_CHUNK = 8


@dataclass(frozen=True)
class PlaceholderRange:
    """The tokens of one item: ``length`` tokens from ``offset``.

    ``is_embed`` marks the positions that take the item's embeddings; ``None`` means all of them.
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(
                f"is_embed has {len(self.is_embed)} entries for a range of {self.length} tokens"
            )

    @property
    def embed_count(self) -> int:
        """How many positions of the range take embeddings."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form: ``offset``, ``length`` and ``is_embed`` (a list, or ``None``)."""
        is_embed = None if self.is_embed is None else [bool(x) for x in self.is_embed]
        return {"offset": self.offset, "length": self.length, "is_embed": is_embed}


class PlaceholderContent(Protocol):
    """The tokens an item puts in the prompt (``PromptUpdateDetails`` is one)."""

    @property
    def full(self) -> tuple[int, ...]:
        """The item's token ids."""
        ...

    @property
    def is_embed(self) -> tuple[bool, ...] | None:
        """One flag per token of ``full``: which take the item's embeddings (``None``: all)."""
        ...


class TokenSearcher:
    """Finds one token pattern in one prompt, answering queries whose start never decreases.

    Knuth-Morris-Pratt with a cursor kept between queries, so one searcher reads each prompt token
    a bounded number of times however many queries it answers. While nothing is pending it jumps
    with ``list.index`` to the next token that can start a match, and compares the run after it
    in doubling slices: the common case (a long run of one placeholder token) runs at C speed
    and the work stays within a constant factor of plain KMP.
    """

    comparisons: ClassVar[int] = 0
    """Token comparisons made by every searcher so far: instrumentation for complexity tests
    (updated once per query, without a lock, so only exact in a single thread)."""

    __slots__ = ("_border", "_i", "_k", "_last", "_pattern", "_prompt")

    def __init__(self, prompt: Sequence[int], pattern: Sequence[int]) -> None:
        # Lists on both sides: slices of a list and a tuple never compare equal.
        self._prompt = prompt if isinstance(prompt, list) else list(prompt)
        self._pattern = list(pattern)
        self._border: list[int] | None = None  # KMP failure function, built on first need
        self._i = 0  # next prompt index to read
        self._k = 0  # pattern tokens matched just before ``_i``
        self._last: int | None = None  # start of the occurrence the last query returned

    def find(self, start: int) -> int | None:
        """Start of the first occurrence at or after ``start`` (``None``: there is none).

        ``start`` must not be smaller than in the previous call. An empty pattern never matches.
        """
        if self._last is not None and self._last >= start:
            return self._last
        if not self._pattern:
            return None
        if self._i <= start:  # a (partial) match that began before ``start`` is of no use
            self._i, self._k = start, 0
        self._last, ops = self._scan(start)
        TokenSearcher.comparisons += ops
        return self._last

    def _scan(self, start: int) -> tuple[int | None, int]:
        prompt, pattern = self._prompt, self._pattern
        n, m = len(prompt), len(pattern)
        i, k, ops = self._i, self._k, 0
        while True:
            if k == m:  # an occurrence ends at i
                if i - m >= start:
                    self._i, self._k = i, k
                    return i - m, ops
                k, cost = self._fallback(m)
                ops += cost
            elif k == 0:
                try:
                    j = prompt.index(pattern[0], i)
                except ValueError:
                    self._i, self._k = n, 0
                    return None, ops + max(n - i, 0)
                k, cost = _common_prefix(prompt, j, pattern)
                i, ops = j + k, ops + j - i + 1 + cost
            elif i == n:
                self._i, self._k = i, k
                return None, ops
            else:
                k, cost = self._step(k, prompt[i])
                i, ops = i + 1, ops + cost

    def _step(self, k: int, token: int) -> tuple[int, int]:
        """The KMP state after reading ``token`` in state ``k``, and the comparisons made."""
        pattern, ops = self._pattern, 1
        while k and pattern[k] != token:
            k, cost = self._fallback(k)
            ops += cost + 1
        return (k + 1 if pattern[k] == token else k), ops

    def _fallback(self, k: int) -> tuple[int, int]:
        """The longest proper border of ``pattern[:k]``, and the cost of building the table."""
        cost = 0
        if self._border is None:
            self._border, cost = _borders(self._pattern)
        return self._border[k - 1], cost


def _borders(pattern: Sequence[int]) -> tuple[list[int], int]:
    """KMP failure function: ``border[q]`` is the longest proper border of ``pattern[:q + 1]``.

    Placeholder contents mostly take one of two shapes whose table needs no Python loop over
    their tokens (330-1300 of them for a Qwen-VL image): a start token found nowhere else in
    the pattern (no prefix has a border) or one token repeated (each border one token shorter).
    """
    m = len(pattern)
    first = pattern.count(pattern[0]) if m else 0
    if first == 1:
        return [0] * m, m
    if first == m:
        return list(range(m)), m
    border, k, ops = [0] * m, 0, 0
    for q in range(1, len(pattern)):
        while k and pattern[q] != pattern[k]:
            k, ops = border[k - 1], ops + 1
        ops += 1
        if pattern[q] == pattern[k]:
            k += 1
        border[q] = k
    return border, ops


def _common_prefix(prompt: list[int], j: int, pattern: list[int]) -> tuple[int, int]:
    """How many tokens of ``pattern`` match ``prompt`` from ``j`` (``prompt[j]`` is known to).

    Compared in doubling slices at C speed, so the cost stays below a few times the result.
    """
    done, step, cost, m = 1, _FIRST_CHUNK, 0, len(pattern)
    while done < m:
        end = min(done + step, m)
        cost += end - done
        if prompt[j + done : j + end] != pattern[done:end]:
            # The mismatch (or the prompt's end) lies in this chunk: find it token by token.
            while j + done < len(prompt) and prompt[j + done] == pattern[done]:
                done += 1
            return done, cost
        done, step = end, step * 2
    return done, cost


def find_placeholders(
    prompt: Sequence[int],
    contents: Mapping[str, Sequence[Sequence[PlaceholderContent]]],
) -> dict[str, list[PlaceholderRange]]:
    """Find each item's content in ``prompt``.

    ``contents`` maps each modality (in priority order) to, per item, the item's alternative
    contents (one per prompt update of the modality, in order). Modalities with no item found are
    absent from the result.
    """
    tokens = prompt if isinstance(prompt, list) else list(prompt)
    searchers: dict[tuple[int, ...], TokenSearcher] = {}
    found: dict[str, list[PlaceholderRange]] = {m: [] for m in contents}

    def candidates(modality: str) -> list[tuple[PlaceholderContent, TokenSearcher]]:
        items, item_idx = contents[modality], len(found[modality])
        if item_idx >= len(items):
            return []
        return [(d, searcher_for(d.full)) for d in items[item_idx] if d.full]

    def searcher_for(full: tuple[int, ...]) -> TokenSearcher:
        # Items with the same content share a searcher: queries only move forward either way.
        if full not in searchers:
            searchers[full] = TokenSearcher(tokens, full)
        return searchers[full]

    current = {m: candidates(m) for m in contents}
    pos = 0
    while True:
        best: tuple[int, str, PlaceholderContent] | None = None
        for modality, cands in current.items():
            for details, searcher in cands:
                start = searcher.find(pos)
                # Strictly earlier only: on a tie the earlier modality and alternative win.
                if start is not None and (best is None or start < best[0]):
                    best = (start, modality, details)
        if best is None:
            break
        start, modality, details = best
        found[modality].append(PlaceholderRange(start, len(details.full), details.is_embed))
        current[modality] = candidates(modality)
        pos = start + len(details.full)
    return {m: ranges for m, ranges in found.items() if ranges}
