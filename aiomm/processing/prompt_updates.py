"""Prompt updates: how a model's placeholders expand in a tokenized prompt, with vLLM's semantics.

A :class:`PromptReplacement` replaces one occurrence of its target per item; a
:class:`PromptInsertion` inserts after it. Targets are token ids or a :class:`PromptIndex`
(``PromptIndexTargets.start()``, ``.prefix(seq)``, ``.end()``: zero-width matches). Targets and
contents may be callables of the item index.

Applying works in rounds from the point the previous round reached (``pos``), on the original
prompt: every item not yet placed takes the first match of its target at or after ``pos``; the
first match met (modalities in the order their updates were given, then items) fixes the round's
mode; an INSERT round places every such item (items after the same target stack in item order),
a REPLACE round places every zero-width match but only the earliest non-empty one. Hence a
replacement consumes one target occurrence per item in prompt order. Matching is
non-overlapping, and one forward-only searcher per distinct target serves every item and round.

Each item's placeholder range is recorded where its content goes in (never re-detected
afterwards). :func:`apply_and_find_partial` reports the items whose target matched nowhere next
to the partly updated prompt; :func:`apply_and_find` raises for them instead. Placeholder ranges
and the token searcher live in :mod:`aiomm.processing.placeholders`, which this module builds on.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Literal, TypeAlias

from aiomm.errors import ItemCountMismatchError, PromptUpdateError, UnknownModalityError
from aiomm.processing.placeholders import PlaceholderRange, TokenSearcher, find_placeholders

__all__ = (
    "PromptIndex",
    "PromptIndexTargets",
    "PromptInsertion",
    "PromptReplacement",
    "PromptSeq",
    "PromptTarget",
    "PromptUpdate",
    "PromptUpdateContent",
    "PromptUpdateDetails",
    "PromptUpdateResult",
    "ResolvedPromptUpdate",
    "ResolvedUpdates",
    "UpdateMode",
    "apply_and_find",
    "apply_and_find_partial",
    "apply_prompt_updates",
    "find_mm_placeholders",
    "resolve_prompt_updates",
)

PromptSeq: TypeAlias = list[int]
"""A prompt: token ids (aiomm never matches on text)."""

# How many tokens of a target an error message shows.
_SHOWN_TOKENS = 8


@dataclass(frozen=True)
class PromptIndex:
    """A zero-width target: a position in the prompt. Build it with :class:`PromptIndexTargets`."""

    kind: Literal["start", "prefix", "end"]
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("start", "prefix", "end"):
            raise PromptUpdateError(f"unknown index target kind {self.kind!r}")
        object.__setattr__(self, "prefix", _token_ids(self.prefix, "prefix"))

    def resolve(self, prompt: Sequence[int]) -> int | None:
        """The position this target denotes in ``prompt``, or ``None`` when it does not match."""
        if self.kind == "start":
            return 0
        if self.kind == "end":
            return len(prompt)
        n = len(self.prefix)
        return n if tuple(prompt[:n]) == self.prefix else None

    def __str__(self) -> str:
        if self.kind == "prefix":
            return f"the position after the prefix {_show(self.prefix)}"
        return f"the {self.kind} of the prompt"


class PromptIndexTargets:
    """Factories of :class:`PromptIndex` targets."""

    @staticmethod
    def start() -> PromptIndex:
        """Before the first token; matches even an empty prompt."""
        return PromptIndex("start")

    @staticmethod
    def prefix(seq: Sequence[int]) -> PromptIndex:
        """Right after ``seq``, only when the prompt starts with it."""
        return PromptIndex("prefix", tuple(seq))

    @staticmethod
    def end() -> PromptIndex:
        """After the last token; matches even an empty prompt."""
        return PromptIndex("end")


PromptTarget: TypeAlias = Sequence[int] | PromptIndex
"""Token ids to match (non-overlapping; an empty sequence never matches), or an index."""


@dataclass(frozen=True)
class PromptUpdateDetails:
    """The tokens an update puts in the prompt, and which of them take the item's embeddings."""

    full: tuple[int, ...]
    is_embed: tuple[bool, ...] | None = None
    """One flag per token of ``full``; ``None`` means every token takes an embedding."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "full", _token_ids(self.full, "content"))
        if self.is_embed is not None:
            object.__setattr__(self, "is_embed", tuple(self.is_embed))
            if len(self.is_embed) != len(self.full):
                raise PromptUpdateError(
                    f"is_embed has {len(self.is_embed)} flags but the content has "
                    f"{len(self.full)} tokens; give one flag per token"
                )

    @staticmethod
    def from_seq(seq: Sequence[int]) -> PromptUpdateDetails:
        """Every token of ``seq`` takes an embedding."""
        return PromptUpdateDetails(_token_ids(seq, "content"))

    @staticmethod
    def select_token_id(seq: Sequence[int], embed_token_id: int) -> PromptUpdateDetails:
        """Only the tokens equal to ``embed_token_id`` take embeddings."""
        full = _token_ids(seq, "content")
        return PromptUpdateDetails(
            full, tuple(map(functools.partial(operator.eq, embed_token_id), full))
        )

    @staticmethod
    def select_token_ids(seq: Sequence[int], embed_token_ids: Sequence[int]) -> PromptUpdateDetails:
        """Only the tokens in ``embed_token_ids`` take embeddings."""
        full = _token_ids(seq, "content")
        return PromptUpdateDetails(full, tuple(map(frozenset(embed_token_ids).__contains__, full)))


PromptUpdateContent: TypeAlias = (
    Sequence[int] | PromptUpdateDetails | Callable[[int], Sequence[int] | PromptUpdateDetails]
)
"""What an update puts in the prompt, or a callable of the item index returning it."""


class UpdateMode(str, Enum):
    """How an update uses its target's match."""

    INSERT = "insert"  # keep the target, put the content right after it
    REPLACE = "replace"  # put the content in place of the target


@dataclass(frozen=True)
class ResolvedPromptUpdate:
    """A prompt update bound to one item: target and content no longer depend on the index."""

    modality: str
    item_idx: int
    target: tuple[int, ...] | PromptIndex
    content: PromptUpdateDetails = field(repr=False)
    mode: UpdateMode


@dataclass(frozen=True)
class _PromptUpdateBase:
    modality: str
    target: PromptTarget | Callable[[int], PromptTarget]
    mode: ClassVar[UpdateMode]

    def __post_init__(self) -> None:
        if not callable(self.target):
            object.__setattr__(self, "target", _as_target(self.target))

    @property
    def content(self) -> PromptUpdateContent:
        raise NotImplementedError

    def resolve(self, item_idx: int) -> ResolvedPromptUpdate:
        """Bind this update to item ``item_idx`` of its modality."""
        target = self.target(item_idx) if callable(self.target) else self.target
        content = self.content(item_idx) if callable(self.content) else self.content
        if not isinstance(content, PromptUpdateDetails):
            content = PromptUpdateDetails.from_seq(_token_ids(content, "content"))
        return ResolvedPromptUpdate(self.modality, item_idx, _as_target(target), content, self.mode)


@dataclass(frozen=True)
class PromptReplacement(_PromptUpdateBase):
    """Replace one occurrence of ``target`` per item with ``replacement``."""

    replacement: PromptUpdateContent = field(repr=False)
    mode: ClassVar[UpdateMode] = UpdateMode.REPLACE

    @property
    def content(self) -> PromptUpdateContent:
        return self.replacement


@dataclass(frozen=True)
class PromptInsertion(_PromptUpdateBase):
    """Insert ``insertion`` right after ``target``, once per item."""

    insertion: PromptUpdateContent = field(repr=False)
    mode: ClassVar[UpdateMode] = UpdateMode.INSERT

    @property
    def content(self) -> PromptUpdateContent:
        return self.insertion


PromptUpdate: TypeAlias = PromptReplacement | PromptInsertion

ResolvedUpdates: TypeAlias = dict[str, list[tuple[ResolvedPromptUpdate, ...]]]
"""Per modality (in priority order), per item, the item's updates in the order they were given."""


def _token_ids(seq: Sequence[int], what: str) -> tuple[int, ...]:
    if isinstance(seq, (str, bytes)):
        raise PromptUpdateError(f"{what} must be token ids, not text ({seq!r}); tokenize it first")
    return tuple(seq)


def _as_target(target: PromptTarget) -> tuple[int, ...] | PromptIndex:
    return target if isinstance(target, PromptIndex) else _token_ids(target, "target")


def _show(target: tuple[int, ...] | PromptIndex) -> str:
    if isinstance(target, PromptIndex):
        return str(target)
    more = ", ..." if len(target) > _SHOWN_TOKENS else ""
    return f"[{', '.join(map(str, target[:_SHOWN_TOKENS]))}{more}]"


# ------------------------------------------------------------------------------------ resolve


def resolve_prompt_updates(
    updates: Sequence[PromptUpdate], mm_item_counts: Mapping[str, int]
) -> ResolvedUpdates:
    """Bind every update to every item of its modality.

    :raises UnknownModalityError: for items of a modality that no update handles.
    """
    by_modality: dict[str, list[PromptUpdate]] = {}
    for update in updates:
        by_modality.setdefault(update.modality, []).append(update)
    for modality, count in mm_item_counts.items():
        if count < 0:
            raise PromptUpdateError(f"item count of {modality!r} is {count}; it must be >= 0")
        if count and modality not in by_modality:
            raise UnknownModalityError(modality, by_modality)
    return {
        modality: [
            tuple(u.resolve(i) for u in modality_updates)
            for i in range(mm_item_counts.get(modality, 0))
        ]
        for modality, modality_updates in by_modality.items()
    }


# -------------------------------------------------------------------------------------- apply


class _TargetMatcher:
    """First match of a target at or after a position that never decreases, on one prompt."""

    def __init__(self, prompt: list[int]) -> None:
        self._prompt = prompt
        self._searchers: dict[tuple[int, ...], TokenSearcher] = {}
        self._indices: dict[PromptIndex, int | None] = {}

    def match(self, target: tuple[int, ...] | PromptIndex, pos: int) -> tuple[int, int] | None:
        if isinstance(target, PromptIndex):
            if target not in self._indices:
                self._indices[target] = target.resolve(self._prompt)
            idx = self._indices[target]
            # An index behind ``pos`` was passed by an earlier round.
            return None if idx is None or idx < pos else (idx, idx)
        if target not in self._searchers:
            self._searchers[target] = TokenSearcher(self._prompt, target)
        start = self._searchers[target].find(pos)
        return None if start is None else (start, start + len(target))


@dataclass(eq=False)
class _Group:
    """Unplaced items of one modality whose updates have the same targets and modes.

    Such items have the same matches, so a round searches once per group rather than per item.
    """

    rank: int  # the modality's priority
    modality: str
    targets: tuple[tuple[UpdateMode, tuple[int, ...] | PromptIndex], ...]
    pending: deque[int] = field(default_factory=deque)


@dataclass(frozen=True)
class _Hit:
    start: int
    end: int
    rank: int
    item: int
    alt: int  # which of the item's updates matched
    group: _Group


def _group_items(resolved: ResolvedUpdates) -> list[_Group]:
    groups: dict[tuple[object, ...], _Group] = {}
    for rank, (modality, items) in enumerate(resolved.items()):
        for item_idx, alternatives in enumerate(items):
            targets = tuple((u.mode, u.target) for u in alternatives)
            group = groups.setdefault((modality, targets), _Group(rank, modality, targets))
            group.pending.append(item_idx)
    return list(groups.values())


def _plan_round(
    groups: list[_Group], matcher: _TargetMatcher, pos: int
) -> tuple[UpdateMode, list[_Hit]] | None:
    """The items one round places, in the order their contents go into the prompt."""
    live = [(g, [matcher.match(t, pos) for _, t in g.targets]) for g in groups if g.pending]
    matched = [(g.rank, g.pending[0], m) for g, ms in live if (m := _first_match(g, ms, None))]
    if not matched:
        return None
    # The first match met in vLLM's visiting order (modality, then item) fixes the mode.
    _, _, (_, mode, _) = min(matched, key=lambda x: x[:2])
    hits: list[_Hit] = []
    for group, matches in live:
        first = _first_match(group, matches, mode)
        if first is None:
            continue
        alt, _, (start, end) = first
        # Items of a group share a match: insertions stack, a replacement consumes it once.
        items = group.pending if mode is UpdateMode.INSERT or start == end else [group.pending[0]]
        hits += [_Hit(start, end, group.rank, i, alt, group) for i in items]
    hits.sort(key=lambda h: (h.start, h.end, h.rank, h.item))
    if mode is UpdateMode.REPLACE:
        # One non-empty replacement per round, so that replacements never overlap.
        kept = next((h for h in hits if h.start != h.end), None)
        hits = [h for h in hits if h.start == h.end or h is kept]
    return mode, hits


def _first_match(
    group: _Group, matches: list[tuple[int, int] | None], mode: UpdateMode | None
) -> tuple[int, UpdateMode, tuple[int, int]] | None:
    """The group's first update (of ``mode``, if given) that matched: its index, mode, match."""
    for alt, ((update_mode, _), span) in enumerate(zip(group.targets, matches, strict=True)):
        if span is not None and mode in (None, update_mode):
            return alt, update_mode, span
    return None


@dataclass(frozen=True)
class _Pass:
    """One application of the updates to a prompt: the raw facts every public form reports."""

    tokens: list[int]
    ranges: dict[str, dict[int, PlaceholderRange]]  # items placed with a non-empty content
    unmatched: dict[str, tuple[int, ...]]  # per modality with any, in priority order
    end: int  # how far into the original prompt the updates reached


def _apply_resolved(prompt: list[int], resolved: ResolvedUpdates) -> _Pass:
    groups = _group_items(resolved)
    matcher = _TargetMatcher(prompt)
    ranges: dict[str, dict[int, PlaceholderRange]] = {m: {} for m in resolved}
    chunks: list[Sequence[int]] = []
    pos = size = 0  # size: tokens written so far, so each content's offset is known as it goes in
    while any(g.pending for g in groups):
        plan = _plan_round(groups, matcher, pos)
        if plan is None:
            break
        mode, hits = plan
        for hit in hits:
            # Stacked insertions cut behind ``pos``: their slice is empty.
            kept = prompt[pos : hit.end if mode is UpdateMode.INSERT else hit.start]
            content = resolved[hit.group.modality][hit.item][hit.alt].content
            offset = size + len(kept)
            if content.full:
                # Recorded where it goes in, never re-detected: an inserted content that starts
                # with its own target would otherwise be reported on the target.
                ranges[hit.group.modality][hit.item] = PlaceholderRange(
                    offset, len(content.full), content.is_embed
                )
            chunks += (kept, content.full)
            size = offset + len(content.full)
            pos = max(pos, hit.end)
            hit.group.pending.popleft()  # hits of a group come in item order
    chunks.append(prompt[pos:])
    unmatched: dict[str, list[int]] = {}
    for group in sorted((g for g in groups if g.pending), key=lambda g: g.rank):
        unmatched.setdefault(group.modality, []).extend(group.pending)
    return _Pass(
        list(itertools.chain.from_iterable(chunks)),
        ranges,
        {m: tuple(sorted(items)) for m, items in unmatched.items()},
        pos,
    )


def apply_prompt_updates(
    prompt: Sequence[int], updates: Sequence[PromptUpdate], mm_item_counts: Mapping[str, int]
) -> list[int]:
    """Apply every item's update to ``prompt`` (token ids) and return the new token ids.

    :raises UnknownModalityError: for items of a modality that no update handles.
    :raises ItemCountMismatchError: when a replacement's target occurs fewer times than there
        are items.
    :raises PromptUpdateError: when some other item's target cannot be matched.
    """
    tokens = list(prompt)
    resolved = resolve_prompt_updates(updates, mm_item_counts)
    applied = _apply_resolved(tokens, resolved)
    _raise_for_unmatched(tokens, resolved, applied)
    return applied.tokens


def _raise_for_unmatched(prompt: list[int], resolved: ResolvedUpdates, applied: _Pass) -> None:
    if not applied.unmatched:
        return
    # The first item in vLLM's visiting order: modalities in priority order, then items.
    modality, unmatched = next(iter(applied.unmatched.items()))
    item_idx, count = unmatched[0], len(resolved[modality])
    target = _fixed_replace_target(resolved[modality])
    if target is not None:
        occurrences = _count_occurrences(prompt, target)
        if occurrences < count:
            raise ItemCountMismatchError(modality, count, occurrences)
    targets = " or ".join(_show(u.target) for u in resolved[modality][item_idx])
    raise PromptUpdateError(
        f"cannot place {modality} item {item_idx}: no match for its target {targets} at or after "
        f"token {applied.end} of the {len(prompt)}-token prompt ({count - len(unmatched)} of "
        f"{count} {modality} item(s) placed); updates apply left to right, one target occurrence "
        "per replaced item"
    )


def _fixed_replace_target(items: list[tuple[ResolvedPromptUpdate, ...]]) -> tuple[int, ...] | None:
    """The target when every item has one replacement of the same token ids, else ``None``."""
    targets = {(u.mode, u.target) for alternatives in items for u in alternatives}
    if len(targets) != 1 or any(len(alternatives) != 1 for alternatives in items):
        return None
    ((mode, target),) = targets
    return target if mode is UpdateMode.REPLACE and isinstance(target, tuple) else None


def _count_occurrences(
    prompt: list[int], target: tuple[int, ...], skip: Sequence[PlaceholderRange] = ()
) -> int:
    """Non-overlapping occurrences of ``target`` that start outside the sorted ``skip`` ranges."""
    searcher, ranges = TokenSearcher(prompt, target), iter(skip)
    current = next(ranges, None)
    count, pos = 0, 0
    while (start := searcher.find(pos)) is not None:
        while current is not None and current.offset + current.length <= start:
            current = next(ranges, None)
        if current is not None and current.offset <= start:
            pos = current.offset + current.length  # inside an item's tokens: not a placeholder
            continue
        count, pos = count + 1, start + len(target)
    return count


# ------------------------------------------------------------------------------------- find


def _may_hold_every_content(prompt: list[int], resolved: ResolvedUpdates) -> bool:
    """False when ``prompt`` cannot hold every item's content: the scan for an already updated
    prompt finds an item only by a non-empty content, and its ranges do not overlap, so the prompt
    needs at least the sum of each item's shortest non-empty content. (The usual prompt, with one
    placeholder token an item, is far shorter than its expanded contents.)"""
    needed = 0
    for items in resolved.values():
        for alternatives in items:
            lengths = [len(u.content.full) for u in alternatives if u.content.full]
            if not lengths:
                return False  # this item can never be found
            needed += min(lengths)
    return len(prompt) >= needed


def _contents(resolved: ResolvedUpdates) -> dict[str, list[tuple[PromptUpdateDetails, ...]]]:
    return {m: [tuple(u.content for u in alts) for alts in items] for m, items in resolved.items()}


def find_mm_placeholders(
    prompt: Sequence[int],
    updates: Sequence[PromptUpdate],
    mm_item_counts: Mapping[str, int],
) -> dict[str, list[PlaceholderRange]]:
    """The placeholder range of every item found in ``prompt`` (already updated), per modality.

    Each item may be found as the content of any of its modality's updates (see
    :func:`~aiomm.processing.placeholders.find_placeholders`); items not found are absent, and a
    missing item hides every later item of its modality.
    """
    contents: dict[str, list[list[PromptUpdateDetails]]] = {}
    for update in updates:
        count = mm_item_counts.get(update.modality, 0)
        per_item = contents.setdefault(update.modality, [[] for _ in range(count)])
        for item_idx, alternatives in enumerate(per_item):
            alternatives.append(update.resolve(item_idx).content)
    return find_placeholders(prompt, contents)


# ------------------------------------------------------------------------------ apply and find


@dataclass(frozen=True)
class PromptUpdateResult:
    """What applying prompt updates achieved, including for items that could not be placed."""

    prompt: list[int]
    """The prompt with the update of every matched item applied."""
    items: dict[str, tuple[PlaceholderRange | None, ...]]
    """Per modality with items (in priority order), per item: the range of its tokens in
    ``prompt``, or ``None`` when it has none (its target matched nowhere, or its content is
    empty)."""
    unmatched: dict[str, tuple[int, ...]]
    """Per modality with any, the indices of the items whose target matched nowhere in the prompt
    (nothing went into the prompt for them), ascending."""
    already_updated: bool
    """Whether the prompt already held every item's content: it was then returned as it was, with
    the ranges a scan finds (no update was applied)."""

    @property
    def placeholders(self) -> dict[str, list[PlaceholderRange]]:
        """The ranges found, per modality with any, in item order (as :func:`apply_and_find`)."""
        found = {m: [r for r in ranges if r is not None] for m, ranges in self.items.items()}
        return {m: ranges for m, ranges in found.items() if ranges}

    @property
    def unmatched_counts(self) -> dict[str, int]:
        """How many items of each modality (with any) matched nowhere."""
        return {m: len(items) for m, items in self.unmatched.items()}

    @property
    def complete(self) -> bool:
        """Whether every item has a range."""
        return all(r is not None for ranges in self.items.values() for r in ranges)


def _apply_and_find(
    prompt: list[int], resolved: ResolvedUpdates
) -> tuple[PromptUpdateResult, _Pass | None]:
    """The result, and the application behind it (``None``: the prompt was already updated)."""
    counts = {m: len(items) for m, items in resolved.items() if items}
    items: dict[str, tuple[PlaceholderRange | None, ...]]
    if _may_hold_every_content(prompt, resolved):
        found = find_placeholders(prompt, _contents(resolved))
        if all(len(found.get(m, ())) == n for m, n in counts.items()):
            # vLLM's scan of an already updated prompt: the n-th range found is item n's.
            items = {m: tuple(found[m]) for m in counts}
            return PromptUpdateResult(prompt, items, {}, already_updated=True), None
    applied = _apply_resolved(prompt, resolved)
    items = {m: tuple(map(applied.ranges[m].get, range(n))) for m, n in counts.items()}
    result = PromptUpdateResult(applied.tokens, items, applied.unmatched, already_updated=False)
    return result, applied


def apply_and_find_partial(
    prompt: Sequence[int], updates: Sequence[PromptUpdate], mm_item_counts: Mapping[str, int]
) -> PromptUpdateResult:
    """Expand the placeholders of ``prompt`` as far as they match, and say which items did.

    The non-raising form of :func:`apply_and_find`, like vLLM's application of token matches:
    an item whose target matches nowhere is reported in ``unmatched`` and the others are still
    applied. A prompt that already contains every item's full content is returned unchanged.

    :raises UnknownModalityError: for items of a modality that no update handles.
    :raises PromptUpdateError: for a negative item count.
    """
    return _apply_and_find(list(prompt), resolve_prompt_updates(updates, mm_item_counts))[0]


def apply_and_find(
    prompt: Sequence[int], updates: Sequence[PromptUpdate], mm_item_counts: Mapping[str, int]
) -> tuple[list[int], dict[str, list[PlaceholderRange]]]:
    """Expand the placeholders of ``prompt`` and find every item's range in the result.

    An item's range is where its content went in (for an insertion: right after its target). A
    prompt that already contains every item's full content is returned unchanged (it is not
    expanded twice); its ranges are then found by scanning, as vLLM does.

    :raises UnknownModalityError: for items of a modality that no update handles.
    :raises ItemCountMismatchError: when a replaced placeholder occurs fewer times than there
        are items, or occurs again outside the items' tokens (more placeholders than items).
    :raises PromptUpdateError: when an item's target cannot be matched, or its content is empty
        (so that it has no range).
    """
    tokens = list(prompt)
    resolved = resolve_prompt_updates(updates, mm_item_counts)
    result, applied = _apply_and_find(tokens, resolved)
    if applied is not None:
        _raise_for_unmatched(tokens, resolved, applied)
        _raise_for_empty(result)
    placeholders = result.placeholders
    _raise_for_extra_placeholders(result.prompt, placeholders, resolved)
    return result.prompt, placeholders


def _raise_for_empty(result: PromptUpdateResult) -> None:
    for modality, ranges in result.items.items():
        for item_idx, found in enumerate(ranges):
            if found is None:
                raise PromptUpdateError(
                    f"{modality} item {item_idx} matched its target but its content is empty, so "
                    f"it has no placeholder range ({len(ranges)} {modality} item(s)); every "
                    "item's content needs at least one token"
                )


def _raise_for_extra_placeholders(
    tokens: list[int], placeholders: dict[str, list[PlaceholderRange]], resolved: ResolvedUpdates
) -> None:
    # HF processors fail on a placeholder left without an item; do not pass one on silently.
    covered = sorted(
        (r for ranges in placeholders.values() for r in ranges), key=lambda r: r.offset
    )
    for modality, items in resolved.items():
        target = _fixed_replace_target(items) if items else None
        if target is None:
            continue
        extra = _count_occurrences(tokens, target, covered)
        if extra:
            raise ItemCountMismatchError(modality, len(items), len(items) + extra)
