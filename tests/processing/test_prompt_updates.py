"""Prompt updates on token ids: vLLM's matching semantics, errors, and linear-time applying.

The table cases restate vLLM's ``tests/multimodal/test_processing.py`` (``test_find_update_tokens``
and the placeholders recorded by ``_apply_token_matches_with_placeholders``) in aiomm's terms.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiomm.errors import (
    ItemCountMismatchError,
    ProcessingError,
    PromptUpdateError,
    UnknownModalityError,
)
from aiomm.processing.placeholders import PlaceholderRange, TokenSearcher, find_placeholders
from aiomm.processing.prompt_updates import (
    PromptIndex,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    PromptUpdateResult,
    ResolvedPromptUpdate,
    UpdateMode,
    apply_and_find,
    apply_and_find_partial,
    apply_prompt_updates,
    resolve_prompt_updates,
)

IMG = 32000
PAD, VS, VE, VPAD = 151655, 151652, 151653, 151656  # Qwen-VL image/video placeholders
T = TypeVar("T")
UpdateType = type[PromptReplacement] | type[PromptInsertion]


def comparisons(fn: Callable[..., T], *args: object) -> tuple[T, int]:
    """``fn(*args)`` and the token comparisons the searchers made meanwhile."""
    before = TokenSearcher.comparisons
    result = fn(*args)
    return result, TokenSearcher.comparisons - before


# ------------------------------------------------------------------------------ targets, types


@pytest.mark.parametrize(
    ("prompt", "target", "expected"),
    [
        ([], PromptIndexTargets.start(), 0),
        ([], PromptIndexTargets.end(), 0),
        ([], PromptIndexTargets.prefix([IMG]), None),
        ([IMG] * 4, PromptIndexTargets.start(), 0),
        ([IMG] * 4, PromptIndexTargets.prefix([IMG]), 1),
        ([IMG] * 4, PromptIndexTargets.end(), 4),
        ([9833, 28747, IMG], PromptIndexTargets.prefix([28747, IMG]), None),
        ([9833, 28747, IMG], PromptIndexTargets.prefix([9833, 28747]), 2),
    ],
)
def test_index_targets(prompt: list[int], target: PromptIndex, expected: int | None) -> None:
    assert target.resolve(prompt) == expected


def test_index_targets_compare_by_value() -> None:
    assert PromptIndexTargets.prefix([1, 2]) == PromptIndexTargets.prefix((1, 2))
    assert PromptIndexTargets.start() != PromptIndexTargets.end()
    assert str(PromptIndexTargets.prefix([1, 2])) == "the position after the prefix [1, 2]"


def test_update_details_masks() -> None:
    seq = [VS, IMG, IMG, VE]
    assert PromptUpdateDetails.from_seq(seq) == PromptUpdateDetails((VS, IMG, IMG, VE))
    assert PromptUpdateDetails.select_token_id(seq, IMG).is_embed == (False, True, True, False)
    assert PromptUpdateDetails.select_token_ids(seq, [VS, VE]).is_embed == (
        True,
        False,
        False,
        True,
    )
    assert PromptUpdateDetails([1, 2]).full == (1, 2)  # type: ignore[arg-type]


def test_update_details_rejects_mask_of_wrong_length() -> None:
    with pytest.raises(PromptUpdateError, match="is_embed has 1 flags but the content has 2"):
        PromptUpdateDetails((1, 2), (True,))


@pytest.mark.parametrize(
    "make",
    [
        lambda: PromptReplacement("image", "<image>", [IMG]),
        lambda: PromptReplacement("image", [IMG], "<image>").resolve(0),
        lambda: PromptUpdateDetails.from_seq("<image>"),  # type: ignore[arg-type]
    ],
)
def test_text_is_rejected(make: Callable[[], Any]) -> None:
    with pytest.raises(PromptUpdateError, match="token ids, not text"):
        make()


def test_resolve_binds_each_item() -> None:
    update = PromptReplacement(
        "image", lambda i: [100 + i], lambda i: PromptUpdateDetails.select_token_id([IMG] * i, IMG)
    )
    resolved = update.resolve(2)
    assert resolved == ResolvedPromptUpdate(
        "image", 2, (102,), PromptUpdateDetails((IMG, IMG), (True, True)), UpdateMode.REPLACE
    )
    assert PromptInsertion("image", PromptIndexTargets.end(), [1]).resolve(0).mode is (
        UpdateMode.INSERT
    )


def test_resolve_groups_by_modality_in_update_order() -> None:
    updates = [
        PromptReplacement("video", [VPAD], [VPAD]),
        PromptReplacement("image", [PAD], [PAD]),
        PromptInsertion("video", PromptIndexTargets.end(), [1]),
    ]
    resolved = resolve_prompt_updates(updates, {"image": 1, "video": 2})
    assert list(resolved) == ["video", "image"]
    assert [len(alts) for alts in resolved["video"]] == [2, 2]
    assert [alts[0].item_idx for alts in resolved["video"]] == [0, 1]


def test_import_stays_light() -> None:
    code = (
        "import sys, aiomm.processing.prompt_updates; "
        "print(sorted({'torch', 'transformers', 'numpy', 'PIL'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------- applying: vLLM cases

PROMPT = [
    1,
    9833,
    28747,
    IMG,
    9833,
    28747,
    IMG,
    IMG,
    918,
]  # "<s>Image:<image>Image:<image><image>!"
TARGETS: dict[str, Any] = {"pattern_1": [IMG], "pattern_2": [9833, 28747], "pattern_3": [918]}
CONTENTS: dict[str, Any] = {
    "pattern_1": [IMG, IMG],  # the content contains the target: must not be matched again
    "pattern_2": [],  # an empty content
    "pattern_3": [1550, 918, 1550],
}


def run(
    prompt: Sequence[int],
    update_type: UpdateType,
    targets: dict[str, Any],
    contents: dict[str, Any],
    count: int,
) -> list[int]:
    updates = [update_type(key, target, contents[key]) for key, target in targets.items()]
    return apply_prompt_updates(prompt, updates, {key: count for key in targets})


@pytest.mark.parametrize(
    ("update_type", "count", "expected"),
    [
        (PromptInsertion, 0, PROMPT),
        (
            PromptInsertion,
            1,
            [1, 9833, 28747, IMG, IMG, IMG, 9833, 28747, IMG, IMG, 918, 1550, 918, 1550],
        ),
        (
            PromptInsertion,
            2,
            [1, 9833, 28747, *[IMG] * 5, 9833, 28747, IMG, IMG, 918, *[1550, 918, 1550] * 2],
        ),
        (PromptReplacement, 0, PROMPT),
        (PromptReplacement, 1, [1, IMG, IMG, 9833, 28747, IMG, IMG, 1550, 918, 1550]),
    ],
)
def test_replacement_vs_insertion(update_type: UpdateType, count: int, expected: list[int]) -> None:
    # Insertions after the same target stack in item order; a replacement consumes one target
    # occurrence per item, in prompt order, even when the matches come out of modality order.
    assert run(PROMPT, update_type, TARGETS, CONTENTS, count) == expected


def test_replacement_consumes_occurrences_in_prompt_order() -> None:
    prompt = [*PROMPT, 918]  # a second "!" for pattern_3's second item
    assert run(prompt, PromptReplacement, TARGETS, CONTENTS, 2) == [
        1,
        *[IMG] * 5,
        *[1550, 918, 1550] * 2,
    ]


def test_replacement_with_too_few_targets_is_an_item_count_mismatch() -> None:
    with pytest.raises(ItemCountMismatchError, match=r"2 pattern_3 item.* 1 pattern_3 placeholder"):
        run(PROMPT, PromptReplacement, TARGETS, CONTENTS, 2)


INDEX_TARGETS = {
    "pattern_1": PromptIndexTargets.start(),
    "pattern_2": PromptIndexTargets.prefix([IMG]),
    "pattern_3": PromptIndexTargets.end(),
}
INDEX_CONTENTS = {"pattern_1": [-1], "pattern_2": [-2], "pattern_3": [-3]}


@pytest.mark.parametrize("update_type", [PromptInsertion, PromptReplacement])
@pytest.mark.parametrize(
    ("count", "expected"),
    [(0, [IMG]), (1, [-1, IMG, -2, -3]), (2, [-1, -1, IMG, -2, -2, -3, -3])],
)
def test_index_targets_give_zero_width_matches(
    update_type: UpdateType, count: int, expected: list[int]
) -> None:
    assert run([IMG], update_type, INDEX_TARGETS, INDEX_CONTENTS, count) == expected


@pytest.mark.parametrize("update_type", [PromptInsertion, PromptReplacement])
@pytest.mark.parametrize(("count", "expected"), [(1, [-1, -3]), (2, [-1, -1, -3, -3])])
def test_start_and_end_match_an_empty_prompt(
    update_type: UpdateType, count: int, expected: list[int]
) -> None:
    targets = {k: INDEX_TARGETS[k] for k in ("pattern_1", "pattern_3")}
    assert run([], update_type, targets, INDEX_CONTENTS, count) == expected


def test_prefix_that_does_not_match_names_the_item() -> None:
    with pytest.raises(
        PromptUpdateError, match=r"cannot place pattern_2 item 0: .* prefix \[32000\]"
    ):
        run([], PromptInsertion, INDEX_TARGETS, INDEX_CONTENTS, 1)


@pytest.mark.parametrize(
    ("update_type", "target", "expected"),
    [
        (PromptInsertion, [IMG], [[IMG, -1, IMG, IMG], [IMG, -1, -2, IMG, IMG]]),
        (PromptReplacement, [IMG], [[-1, IMG, IMG], [-1, -2, IMG]]),
        (
            PromptInsertion,
            PromptIndexTargets.prefix([IMG]),
            [[IMG, -1, IMG, IMG], [IMG, -1, -2, IMG, IMG]],
        ),
        (
            PromptReplacement,
            PromptIndexTargets.prefix([IMG]),
            [[IMG, -1, IMG, IMG], [IMG, -1, -2, IMG, IMG]],
        ),
    ],
)
def test_per_item_content(update_type: UpdateType, target: Any, expected: list[list[int]]) -> None:
    update = update_type("image", target, lambda i: [-(i + 1)])
    for count, want in enumerate(expected, start=1):
        assert apply_prompt_updates([IMG] * 3, [update], {"image": count}) == want


def test_per_item_target() -> None:
    # Phi-3-V style: item i replaces its own "<|image_{i+1}|>" tag, wherever it is.
    update = PromptReplacement("image", lambda i: [-(i + 1)], lambda i: [100 + i] * 2)
    prompt = [7, -2, 8, -1, 9]
    assert apply_prompt_updates(prompt, [update], {"image": 2}) == [7, 101, 101, 8, 100, 100, 9]


def test_stacked_insertions_keep_item_order_across_rounds() -> None:
    updates = [PromptInsertion("image", [5], lambda i: [10 + i])]
    assert apply_prompt_updates([1, 5, 2, 5], updates, {"image": 3}) == [1, 5, 10, 11, 12, 2, 5]


def test_first_match_fixes_the_round_mode() -> None:
    # Both modalities match; "image" is visited first, so the first round replaces. The video
    # insertion at the start was passed by then and cannot be placed.
    updates = [
        PromptReplacement("image", [PAD], [PAD, PAD]),
        PromptInsertion("video", PromptIndexTargets.start(), [VPAD]),
    ]
    assert apply_prompt_updates([1, PAD], updates, {"image": 1}) == [1, PAD, PAD]
    with pytest.raises(PromptUpdateError, match="cannot place video item 0"):
        apply_prompt_updates([1, PAD], updates, {"image": 1, "video": 1})
    # Visited in the other order, the insertion goes first and both are placed.
    assert apply_prompt_updates([1, PAD], updates[::-1], {"image": 1, "video": 1}) == [
        VPAD,
        1,
        PAD,
        PAD,
    ]


def test_shared_target_goes_to_the_earlier_modality() -> None:
    updates = [PromptReplacement("a", [IMG], [-1]), PromptReplacement("b", [IMG], [-2])]
    assert apply_prompt_updates([IMG, IMG], updates, {"a": 1, "b": 1}) == [-1, -2]
    assert apply_prompt_updates([IMG, IMG], updates[::-1], {"a": 1, "b": 1}) == [-2, -1]


def test_alternative_updates_of_one_modality() -> None:
    # Each item takes the first of its updates that matches (not the earliest match), so item 0
    # replaces the image token and item 1 falls back to "!".
    updates = [
        PromptReplacement("image", [IMG], [-1]),
        PromptReplacement("image", [918], [-2]),
    ]
    assert apply_prompt_updates([IMG, 918], updates, {"image": 2}) == [-1, -2]
    with pytest.raises(
        PromptUpdateError, match=r"item 1: no match for its target \[32000\] or \[918\]"
    ):
        apply_prompt_updates([918, IMG], updates, {"image": 2})


# --------------------------------------------------- placeholders recorded where contents go in

Span = tuple[int, int] | None  # (offset, length) of an item's range; None: the item has none


@pytest.mark.parametrize(
    ("prompt", "update_type", "targets", "contents", "count", "expected", "spans", "unmatched"),
    [
        pytest.param(
            PROMPT,
            PromptInsertion,
            TARGETS,
            CONTENTS,
            1,
            [1, 9833, 28747, IMG, IMG, IMG, 9833, 28747, IMG, IMG, 918, 1550, 918, 1550],
            # The inserted IMG IMG sits after the target IMG at 3: its range starts at 4, not 3.
            {"pattern_1": [(4, 2)], "pattern_2": [None], "pattern_3": [(11, 3)]},
            {},
            id="insert-one-each",
        ),
        pytest.param(
            PROMPT,
            PromptInsertion,
            TARGETS,
            CONTENTS,
            2,
            [1, 9833, 28747, *[IMG] * 5, 9833, 28747, IMG, IMG, 918, *[1550, 918, 1550] * 2],
            {
                "pattern_1": [(4, 2), (6, 2)],
                "pattern_2": [None, None],
                "pattern_3": [(13, 3), (16, 3)],
            },
            {},
            id="insert-two-each-stacked",
        ),
        pytest.param(
            PROMPT,
            PromptReplacement,
            TARGETS,
            CONTENTS,
            1,
            [1, IMG, IMG, 9833, 28747, IMG, IMG, 1550, 918, 1550],
            {"pattern_1": [(1, 2)], "pattern_2": [None], "pattern_3": [(7, 3)]},
            {},
            id="replace-one-each",
        ),
        pytest.param(
            PROMPT,
            PromptReplacement,
            TARGETS,
            CONTENTS,
            2,
            [1, *[IMG] * 5, 1550, 918, 1550],
            # Only one "!" for two pattern_3 items: the second is left unmatched.
            {"pattern_1": [(1, 2), (3, 2)], "pattern_2": [None, None], "pattern_3": [(6, 3), None]},
            {"pattern_3": (1,)},
            id="replace-two-each-one-short",
        ),
        *(
            pytest.param(
                [],
                update_type,
                INDEX_TARGETS,
                INDEX_CONTENTS,
                1,
                [-1, -3],
                {"pattern_1": [(0, 1)], "pattern_2": [None], "pattern_3": [(1, 1)]},
                {"pattern_2": (0,)},  # an empty prompt has no prefix
                id=f"{update_type.__name__}-index-empty-prompt",
            )
            for update_type in (PromptInsertion, PromptReplacement)
        ),
        *(
            pytest.param(
                [IMG],
                update_type,
                INDEX_TARGETS,
                INDEX_CONTENTS,
                count,
                expected,
                spans,
                {},
                id=f"{update_type.__name__}-index-{count}",
            )
            for update_type in (PromptInsertion, PromptReplacement)
            for count, expected, spans in [
                (
                    1,
                    [-1, IMG, -2, -3],
                    {"pattern_1": [(0, 1)], "pattern_2": [(2, 1)], "pattern_3": [(3, 1)]},
                ),
                (
                    2,
                    [-1, -1, IMG, -2, -2, -3, -3],
                    {
                        "pattern_1": [(0, 1), (1, 1)],
                        "pattern_2": [(3, 1), (4, 1)],
                        "pattern_3": [(5, 1), (6, 1)],
                    },
                ),
            ]
        ),
        pytest.param(
            [IMG] * 3,
            PromptInsertion,
            {"image": [IMG]},
            {"image": lambda i: [-(i + 1)]},
            2,
            [IMG, -1, -2, IMG, IMG],
            {"image": [(1, 1), (2, 1)]},
            {},
            id="insert-per-item-content",
        ),
        pytest.param(
            [IMG] * 3,
            PromptReplacement,
            {"image": [IMG]},
            {"image": lambda i: [-(i + 1)]},
            2,
            [-1, -2, IMG],
            {"image": [(0, 1), (1, 1)]},
            {},
            id="replace-per-item-content",
        ),
        *(
            pytest.param(
                [IMG] * 3,
                update_type,
                {"image": PromptIndexTargets.prefix([IMG])},
                {"image": lambda i: [-(i + 1)]},
                2,
                [IMG, -1, -2, IMG, IMG],
                {"image": [(1, 1), (2, 1)]},
                {},
                id=f"{update_type.__name__}-prefix-per-item-content",
            )
            for update_type in (PromptInsertion, PromptReplacement)
        ),
    ],
)
def test_ranges_are_recorded_where_contents_go_in(
    prompt: list[int],
    update_type: UpdateType,
    targets: dict[str, Any],
    contents: dict[str, Any],
    count: int,
    expected: list[int],
    spans: dict[str, list[Span]],
    unmatched: dict[str, tuple[int, ...]],
) -> None:
    updates = [update_type(key, target, contents[key]) for key, target in targets.items()]
    result = apply_and_find_partial(prompt, updates, {key: count for key in targets})
    assert result.prompt == expected
    assert {
        m: [None if r is None else (r.offset, r.length) for r in ranges]
        for m, ranges in result.items.items()
    } == spans
    assert result.unmatched == unmatched
    assert not result.already_updated
    for update in updates:  # every range holds exactly its item's content
        for item_idx, found in enumerate(result.items[update.modality]):
            if found is not None:
                content = update.resolve(item_idx).content.full
                assert tuple(result.prompt[found.offset : found.offset + found.length]) == content


@pytest.mark.parametrize(
    ("count", "expected", "offsets"),
    [(1, [5, 7, 7, 7, 7, 9], [2]), (2, [5, 7, *[7] * 6, 9], [2, 5])],
)
def test_insertion_that_starts_with_its_target_is_found_where_inserted(
    count: int, expected: list[int], offsets: list[int]
) -> None:
    # A scan of the result would meet [7, 7, 7] at the original target first (offset 1).
    update = PromptInsertion("image", [7], [7, 7, 7])
    tokens, ranges = apply_and_find([5, 7, 9], [update], {"image": count})
    assert tokens == expected
    assert ranges == {"image": [PlaceholderRange(offset, 3) for offset in offsets]}


def test_insertion_after_a_prefix_keeps_its_mask_where_inserted() -> None:
    content = PromptUpdateDetails.select_token_id([VS, VS, PAD, VE], PAD)
    update = PromptInsertion("image", PromptIndexTargets.prefix([VS]), content)
    tokens, ranges = apply_and_find([VS, 1], [update], {"image": 1})
    assert tokens == [VS, VS, VS, PAD, VE, 1]
    assert ranges == {"image": [PlaceholderRange(1, 4, (False, False, True, False))]}


def test_items_placed_out_of_prompt_order_keep_their_index() -> None:
    # Phi-3-V style tags in reverse order: item 1's tag comes first in the prompt.
    update = PromptReplacement("image", lambda i: [-(i + 1)], lambda i: [100 + i] * (i + 2))
    tokens, ranges = apply_and_find([7, -2, 8, -1, 9], [update], {"image": 2})
    assert tokens == [7, 101, 101, 101, 8, 100, 100, 9]
    assert ranges == {"image": [PlaceholderRange(5, 2), PlaceholderRange(1, 3)]}


# ----------------------------------------------------------------- reference: vLLM's rounds


def naive_match(
    prompt: Sequence[int], target: tuple[int, ...] | PromptIndex, pos: int
) -> tuple[int, int] | None:
    if isinstance(target, PromptIndex):
        idx = target.resolve(prompt)
        return None if idx is None or idx < pos else (idx, idx)
    m = len(target)
    for i in range(pos, len(prompt) - m + 1):
        if m and tuple(prompt[i : i + m]) == target:
            return i, i + m
    return None


class ReferenceResult(NamedTuple):
    prompt: list[int]
    spans: dict[str, list[Span]]  # per modality with items, per item
    unplaced: dict[str, tuple[int, ...]]  # per modality with any


def reference_apply(
    prompt: list[int], updates: Sequence[PromptUpdate], counts: dict[str, int]
) -> ReferenceResult:
    """vLLM's rounds, item by item and rescanning each time, noting where each content goes."""
    resolved = resolve_prompt_updates(updates, counts)
    spans: dict[str, list[Span]] = {
        m: [None] * len(items) for m, items in resolved.items() if items
    }
    unplaced = {(m, i) for m, items in resolved.items() for i in range(len(items))}
    out: list[int] = []
    pos = 0
    while unplaced:
        mode, hits = None, []
        for rank, (modality, items) in enumerate(resolved.items()):
            for item_idx, alternatives in enumerate(items):
                if (modality, item_idx) not in unplaced:
                    continue
                for update in alternatives:
                    span = naive_match(prompt, update.target, pos)
                    if span is None:
                        continue
                    mode = mode or update.mode
                    if update.mode is mode:
                        hits.append((span, rank, item_idx, update))
                        break
        if mode is None:
            break
        hits.sort(key=lambda h: h[0])
        if mode is UpdateMode.REPLACE:
            nonempty = [h for h in hits if h[0][0] != h[0][1]][:1]
            hits = [h for h in hits if h[0][0] == h[0][1] or h in nonempty]
        for (start, end), _, item_idx, update in hits:
            out += prompt[pos : end if mode is UpdateMode.INSERT else start]
            if update.content.full:
                spans[update.modality][item_idx] = (len(out), len(update.content.full))
            out += update.content.full
            pos = max(pos, end)
            unplaced.discard((update.modality, item_idx))
    left = {m: tuple(sorted(i for mm, i in unplaced if mm == m)) for m in resolved}
    return ReferenceResult(out + prompt[pos:], spans, {m: ix for m, ix in left.items() if ix})


TOKENS = st.integers(1, 3)


@st.composite
def update_cases(draw: st.DrawFn) -> tuple[list[int], list[PromptUpdate], dict[str, int]]:
    prompt = draw(st.lists(TOKENS, max_size=12))
    index_targets = st.sampled_from(
        [PromptIndexTargets.start(), PromptIndexTargets.end(), PromptIndexTargets.prefix([1])]
    )
    targets = st.one_of(st.lists(TOKENS, min_size=1, max_size=3), index_targets)
    updates: list[PromptUpdate] = []
    for modality in draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True)):
        for _ in range(draw(st.integers(1, 2))):
            update_type = draw(st.sampled_from([PromptInsertion, PromptReplacement]))
            base = draw(st.lists(st.integers(4, 6), max_size=2))
            content = (lambda i, b=base: [*b, 10 + i]) if draw(st.booleans()) else [*base, 9]
            updates.append(update_type(modality, draw(targets), content))
    counts = {u.modality: draw(st.integers(0, 3)) for u in updates}
    return prompt, updates, counts


@given(update_cases())
def test_apply_matches_reference_rounds(
    case: tuple[list[int], list[PromptUpdate], dict[str, int]],
) -> None:
    prompt, updates, counts = case
    reference = reference_apply(prompt, updates, counts)
    if not reference.unplaced:
        assert apply_prompt_updates(prompt, updates, counts) == reference.prompt
    else:
        with pytest.raises(ProcessingError):
            apply_prompt_updates(prompt, updates, counts)


def already_updated(
    prompt: list[int], updates: Sequence[PromptUpdate], counts: dict[str, int]
) -> bool:
    """Whether ``prompt`` already holds every item's content (then it is left as it is)."""
    resolved = resolve_prompt_updates(updates, counts)
    contents = {m: [[u.content for u in alts] for alts in items] for m, items in resolved.items()}
    found = find_placeholders(prompt, contents)
    return all(len(found.get(m, ())) == len(items) for m, items in contents.items())


@given(update_cases())
def test_partial_result_matches_reference_rounds(
    case: tuple[list[int], list[PromptUpdate], dict[str, int]],
) -> None:
    prompt, updates, counts = case
    result = apply_and_find_partial(prompt, updates, counts)
    if already_updated(prompt, updates, counts):
        assert (result.prompt, result.unmatched, result.already_updated) == (prompt, {}, True)
        assert result.complete
        return
    reference = reference_apply(prompt, updates, counts)
    assert result.prompt == reference.prompt
    assert result.unmatched == reference.unplaced
    assert result.unmatched_counts == {m: len(ix) for m, ix in reference.unplaced.items()}
    assert {
        m: [None if r is None else (r.offset, r.length) for r in ranges]
        for m, ranges in result.items.items()
    } == reference.spans
    assert result.complete == (not reference.unplaced)  # contents here are never empty
    if reference.unplaced:
        with pytest.raises(ProcessingError):  # the raising form refuses what is left out
            apply_and_find(prompt, updates, counts)


# ---------------------------------------------------------------------------- apply_and_find


def qwen_updates(sizes: list[int], video_sizes: Sequence[int] = ()) -> list[PromptUpdate]:
    return [
        PromptReplacement("image", [PAD], lambda i: PromptUpdateDetails.from_seq([PAD] * sizes[i])),
        PromptReplacement("video", [VPAD], lambda i: [VPAD] * video_sizes[i]),
    ]


def test_apply_and_find_expands_and_finds() -> None:
    prompt = [1, VS, PAD, VE, 2, VS, PAD, VE, 3]
    tokens, ranges = apply_and_find(prompt, qwen_updates([3, 1]), {"image": 2})
    assert tokens == [1, VS, PAD, PAD, PAD, VE, 2, VS, PAD, VE, 3]
    assert ranges == {"image": [PlaceholderRange(2, 3), PlaceholderRange(8, 1)]}


def test_apply_and_find_mixed_modalities() -> None:
    prompt = [1, VS, VPAD, VE, VS, PAD, VE, 2]
    tokens, ranges = apply_and_find(prompt, qwen_updates([2], [3]), {"image": 1, "video": 1})
    assert tokens == [1, VS, VPAD, VPAD, VPAD, VE, VS, PAD, PAD, VE, 2]
    assert ranges == {"image": [PlaceholderRange(7, 2)], "video": [PlaceholderRange(2, 3)]}


def test_apply_and_find_does_not_expand_twice() -> None:
    prompt = [1, VS, PAD, PAD, PAD, VE, 2]
    tokens, ranges = apply_and_find(prompt, qwen_updates([3]), {"image": 1})
    assert tokens == prompt
    assert ranges == {"image": [PlaceholderRange(2, 3)]}
    again, _ = apply_and_find([1, VS, PAD, VE, 2], qwen_updates([3]), {"image": 1})
    assert again == prompt


def test_apply_and_find_with_is_embed_and_insertion() -> None:
    # Pixtral-like rows with a break token, inserted after a prefix.
    content = PromptUpdateDetails.select_token_id([IMG, IMG, 12, IMG, IMG, 13], IMG)
    update = PromptInsertion("image", PromptIndexTargets.prefix([1]), content)
    tokens, ranges = apply_and_find([1, 2, 3], [update], {"image": 1})
    assert tokens == [1, IMG, IMG, 12, IMG, IMG, 13, 2, 3]
    (only,) = ranges["image"]
    assert (only.offset, only.length, only.embed_count) == (1, 6, 4)
    assert only.is_embed == (True, True, False, True, True, False)


def test_apply_and_find_without_items_leaves_the_prompt() -> None:
    prompt = [1, 2, 3]
    assert apply_and_find(prompt, qwen_updates([]), {}) == (prompt, {})
    assert apply_and_find(prompt, [], {"image": 0}) == (prompt, {})


def test_more_items_than_placeholders() -> None:
    with pytest.raises(ItemCountMismatchError) as info:
        apply_and_find([1, VS, PAD, VE], qwen_updates([4, 4]), {"image": 2})
    assert (info.value.num_items, info.value.num_placeholders) == (2, 1)
    assert "2 image item(s) but the prompt has 1 image placeholder(s)" in str(info.value)


def test_more_placeholders_than_items() -> None:
    prompt = [1, VS, PAD, VE, VS, PAD, VE]
    with pytest.raises(ItemCountMismatchError, match=r"1 image item.* 2 image placeholder"):
        apply_and_find(prompt, qwen_updates([4]), {"image": 1})


def test_unknown_modality() -> None:
    with pytest.raises(UnknownModalityError, match=r"'audio'.*\['image', 'video'\]"):
        apply_and_find([1, PAD], qwen_updates([1]), {"image": 1, "audio": 1})


def test_negative_count() -> None:
    with pytest.raises(PromptUpdateError, match="item count of 'image' is -1"):
        apply_and_find([1], qwen_updates([]), {"image": -1})


def test_empty_content_matches_but_has_no_range() -> None:
    update = PromptReplacement("image", [PAD], [])  # removes the placeholder: nothing to point at
    result = apply_and_find_partial([1, PAD], [update], {"image": 1})
    assert (result.prompt, result.items, result.unmatched) == ([1], {"image": (None,)}, {})
    assert not result.complete
    with pytest.raises(PromptUpdateError, match=r"image item 0 matched .* content is empty"):
        apply_and_find([1, PAD], [update], {"image": 1})


def test_missing_per_item_target_names_modality_and_item() -> None:
    update = PromptReplacement("image", lambda i: [-(i + 1)], [PAD])
    with pytest.raises(PromptUpdateError, match=r"cannot place image item 1: .*target \[-2\]"):
        apply_and_find([7, -1, 8], [update], {"image": 2})


# ------------------------------------------------------------------- apply_and_find_partial


def test_partial_applies_what_matches_and_reports_the_rest() -> None:
    prompt = [1, VS, PAD, VE, VS, VPAD, VE]  # one image placeholder for two images
    updates = qwen_updates([3, 2], [2])
    result = apply_and_find_partial(prompt, updates, {"image": 2, "video": 1})
    assert result == PromptUpdateResult(
        prompt=[1, VS, PAD, PAD, PAD, VE, VS, VPAD, VPAD, VE],
        items={"image": (PlaceholderRange(2, 3), None), "video": (PlaceholderRange(7, 2),)},
        unmatched={"image": (1,)},
        already_updated=False,
    )
    assert result.unmatched_counts == {"image": 1}
    assert result.placeholders == {
        "image": [PlaceholderRange(2, 3)],
        "video": [PlaceholderRange(7, 2)],
    }
    assert not result.complete
    with pytest.raises(ItemCountMismatchError, match=r"2 image item.* 1 image placeholder"):
        apply_and_find(prompt, updates, {"image": 2, "video": 1})


def test_partial_lists_unmatched_modalities_in_priority_order() -> None:
    updates = [PromptInsertion("video", [VPAD], [-1]), PromptInsertion("image", [PAD], [-2])]
    result = apply_and_find_partial([1, 2], updates, {"image": 2, "video": 3})
    assert (result.prompt, result.placeholders) == ([1, 2], {})
    assert result.unmatched == {"video": (0, 1, 2), "image": (0, 1)}
    assert list(result.unmatched_counts.items()) == [("video", 3), ("image", 2)]
    assert list(result.items) == ["video", "image"]


def test_partial_keeps_unmatched_indices_of_a_middle_item() -> None:
    # Per-item tags: item 1's tag is missing, items 0 and 2 are still placed.
    update = PromptReplacement("image", lambda i: [-(i + 1)], lambda i: [100 + i])
    result = apply_and_find_partial([-1, 5, -3], [update], {"image": 3})
    assert result.prompt == [100, 5, 102]
    assert result.items == {"image": (PlaceholderRange(0, 1), None, PlaceholderRange(2, 1))}
    assert result.unmatched == {"image": (1,)}
    with pytest.raises(PromptUpdateError, match=r"cannot place image item 1: .*target \[-2\]"):
        apply_and_find([-1, 5, -3], [update], {"image": 3})


def test_partial_of_a_complete_prompt_agrees_with_apply_and_find() -> None:
    prompt, updates = [1, VS, PAD, VE, 2, VS, PAD, VE], qwen_updates([3, 1])
    result = apply_and_find_partial(prompt, updates, {"image": 2})
    assert result.complete and not result.already_updated and result.unmatched == {}
    assert (result.prompt, result.placeholders) == apply_and_find(prompt, updates, {"image": 2})


def test_partial_leaves_an_updated_prompt_as_it_is() -> None:
    prompt = [1, VS, PAD, PAD, PAD, VE, 2]
    result = apply_and_find_partial(prompt, qwen_updates([3]), {"image": 1})
    assert (result.prompt, result.already_updated, result.complete) == (prompt, True, True)
    assert result.items == {"image": (PlaceholderRange(2, 3),)}


def test_a_prompt_too_short_for_the_contents_is_not_scanned(monkeypatch) -> None:
    # one placeholder token per item: 5 tokens cannot already hold the contents (4 + 3 tokens)
    import aiomm.processing.prompt_updates as pu

    scans: list[int] = []
    real = pu.find_placeholders
    monkeypatch.setattr(pu, "find_placeholders", lambda *a: scans.append(1) or real(*a))
    prompt, updates = [1, PAD, 2, PAD, 3], qwen_updates([4, 3])
    new, placeholders = apply_and_find(prompt, updates, {"image": 2})
    assert new == [1, *[PAD] * 4, 2, *[PAD] * 3, 3] and scans == []
    assert placeholders == {"image": [PlaceholderRange(1, 4), PlaceholderRange(6, 3)]}
    # long enough: scanned, and left as it is
    assert apply_and_find(new, updates, {"image": 2}) == (new, placeholders) and scans == [1]


def test_partial_still_rejects_bad_arguments() -> None:
    with pytest.raises(UnknownModalityError):
        apply_and_find_partial([1, PAD], qwen_updates([1]), {"audio": 1})
    with pytest.raises(PromptUpdateError, match="item count of 'image' is -1"):
        apply_and_find_partial([1], qwen_updates([]), {"image": -1})


# -------------------------------------------------------------------------------- complexity


def adversarial_apply(n: int, k: int) -> tuple[list[int], int]:
    prompt = [1] * (n - 1) + [2]
    update = PromptReplacement("image", [1] * k + [2], [7])
    return comparisons(apply_prompt_updates, prompt, [update], {"image": 1})


@pytest.mark.parametrize("k", [1, 64, 1000])
def test_apply_is_linear_on_adversarial_prompt(k: int) -> None:
    n = 30_000
    tokens, ops = adversarial_apply(n, k)
    assert tokens == [1] * (n - 1 - k) + [7]
    assert ops <= 4 * n
    _, ops_doubled = adversarial_apply(2 * n, k)
    assert ops_doubled <= 2.1 * ops


def test_apply_without_match_is_linear() -> None:
    prompt = [1] * 10_000
    with pytest.raises(ItemCountMismatchError):
        comparisons(
            apply_prompt_updates, prompt, [PromptReplacement("image", [0], [-1])], {"image": 1}
        )
    _, ops = comparisons(
        apply_prompt_updates,
        prompt,
        [PromptInsertion("image", PromptIndexTargets.end(), [-1])],
        {"image": 1},
    )
    assert ops == 0


@pytest.mark.parametrize("update_type", [PromptReplacement, PromptInsertion])
def test_many_items_share_one_search(
    update_type: UpdateType, monkeypatch: pytest.MonkeyPatch
) -> None:
    queries = 0
    find = TokenSearcher.find

    def counting_find(self: TokenSearcher, start: int) -> int | None:
        nonlocal queries
        queries += 1
        return find(self, start)

    monkeypatch.setattr(TokenSearcher, "find", counting_find)
    for count in (1000, 4000):
        queries = 0
        tokens = apply_prompt_updates(
            [0] * count, [update_type("image", [0], [1] * 50)], {"image": count}
        )
        assert len(tokens) == count * 50 + (count if update_type is PromptInsertion else 0)
        assert queries <= count + 1  # one query per round, not one per item per round


def test_apply_and_find_many_large_items_is_linear() -> None:
    sizes = [1000 + 7 * i for i in range(100)]
    prompt: list[int] = []
    for _ in sizes:
        prompt += [5, 6, VS, PAD, VE]
    (tokens, ranges), ops = comparisons(apply_and_find, prompt, qwen_updates(sizes), {"image": 100})
    assert [r.length for r in ranges["image"]] == sizes
    assert ops <= 3 * len(tokens)
