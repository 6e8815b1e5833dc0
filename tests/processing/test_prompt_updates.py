"""Prompt updates on token ids: vLLM's matching semantics, errors, and linear-time applying."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiomm.errors import (
    ItemCountMismatchError,
    ProcessingError,
    PromptUpdateError,
    UnknownModalityError,
)
from aiomm.processing.placeholders import PlaceholderRange, TokenSearcher
from aiomm.processing.prompt_updates import (
    PromptIndex,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    UpdateMode,
    apply_and_find,
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


def reference_apply(
    prompt: list[int], updates: Sequence[PromptUpdate], counts: dict[str, int]
) -> tuple[list[int], bool]:
    """vLLM's rounds, item by item and rescanning each time; also says if every item was placed."""
    resolved = resolve_prompt_updates(updates, counts)
    placed = {(m, i) for m, items in resolved.items() for i in range(len(items))}
    out: list[int] = []
    pos = 0
    while placed:
        mode, hits = None, []
        for rank, (modality, items) in enumerate(resolved.items()):
            for item_idx, alternatives in enumerate(items):
                if (modality, item_idx) not in placed:
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
            out += update.content.full
            pos = max(pos, end)
            placed.discard((update.modality, item_idx))
    return out + prompt[pos:], not placed


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
    expected, all_placed = reference_apply(prompt, updates, counts)
    if all_placed:
        assert apply_prompt_updates(prompt, updates, counts) == expected
    else:
        with pytest.raises(ProcessingError):
            apply_prompt_updates(prompt, updates, counts)


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


def test_content_not_found_after_applying() -> None:
    update = PromptReplacement("image", [PAD], [])  # an empty content cannot be located
    with pytest.raises(PromptUpdateError, match=r"image item 0 .* was not found after token 0"):
        apply_and_find([1, PAD], [update], {"image": 1})


def test_missing_per_item_target_names_modality_and_item() -> None:
    update = PromptReplacement("image", lambda i: [-(i + 1)], [PAD])
    with pytest.raises(PromptUpdateError, match=r"cannot place image item 1: .*target \[-2\]"):
        apply_and_find([7, -1, 8], [update], {"image": 2})


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
