"""Placeholder ranges and the linear-time token searcher behind them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from python_source import parse_file

from aiomm.processing import placeholders
from aiomm.processing.placeholders import PlaceholderRange, TokenSearcher, find_placeholders
from aiomm.processing.prompt_updates import (
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
    find_mm_placeholders,
)

IMG, VS, VE = 32000, 151652, 151653
T = TypeVar("T")


def naive_matches(prompt: Sequence[int], pattern: Sequence[int]) -> list[int]:
    """Non-overlapping occurrences, leftmost first: the reference for the searcher."""
    starts, i, m = [], 0, len(pattern)
    while m and i + m <= len(prompt):
        if list(prompt[i : i + m]) == list(pattern):
            starts.append(i)
            i += m
        else:
            i += 1
    return starts


def searcher_matches(prompt: list[int], pattern: Sequence[int]) -> list[int]:
    searcher, starts, pos = TokenSearcher(prompt, pattern), [], 0
    while (start := searcher.find(pos)) is not None:
        starts.append(start)
        pos = start + len(pattern)
    return starts


def reference_find(
    prompt: Sequence[int], contents: Mapping[str, Sequence[Sequence[PromptUpdateDetails]]]
) -> dict[str, list[PlaceholderRange]]:
    """vLLM's scan, one position at a time: the reference for ``find_placeholders``."""
    found: dict[str, list[PlaceholderRange]] = {m: [] for m in contents}
    pos = 0
    while pos < len(prompt):
        for modality, items in contents.items():
            item_idx = len(found[modality])
            if item_idx >= len(items):
                continue
            hit = next(
                (
                    d
                    for d in items[item_idx]
                    if d.full and tuple(prompt[pos : pos + len(d.full)]) == d.full
                ),
                None,
            )
            if hit is not None:
                found[modality].append(PlaceholderRange(pos, len(hit.full), hit.is_embed))
                pos += len(hit.full)
                break
        else:
            pos += 1
    return {m: r for m, r in found.items() if r}


def comparisons(fn: Callable[..., T], *args: object) -> tuple[T, int]:
    """``fn(*args)`` and the token comparisons the searchers made meanwhile."""
    before = TokenSearcher.comparisons
    result = fn(*args)
    return result, TokenSearcher.comparisons - before


# --------------------------------------------------------------------------------- layering


def test_placeholders_never_imports_prompt_updates() -> None:
    # prompt_updates builds on placeholders; not even a type-checking or function-level import
    # may point back.
    tree = parse_file(Path(placeholders.__file__))
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported += [f"{node.module or ''}.{alias.name}" for alias in node.names]
    assert imported, "the scan found no imports at all"
    assert [name for name in imported if "prompt_updates" in name] == []
    code = (
        "import sys, aiomm.processing.placeholders; "
        "print('aiomm.processing.prompt_updates' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ TokenSearcher


@pytest.mark.parametrize(
    ("prompt", "pattern", "expected"),
    [
        ([], [], []),
        ([], [IMG], []),
        ([1, 2, 3], [], []),
        ([IMG] * 3, [IMG], [0, 1, 2]),
        ([IMG] * 3, [IMG] * 2, [0]),  # non-overlapping: the second match would reuse token 1
        ([IMG] * 4, [IMG] * 2, [0, 2]),
        ([IMG] * 3, [IMG] * 3, [0]),
        ([9833, 28747, IMG, IMG, IMG, 9833, 28747, IMG, IMG, 918], [28747, IMG], [1, 6]),
        ([9833, 28747, IMG, IMG, IMG, 9833, 28747, IMG, IMG, 918], [28747, IMG, IMG, IMG], [1]),
        ([9833, 28747, IMG, IMG, IMG, 9833, 28747, IMG, IMG, 918], [28747, 0, IMG], []),
        ([1, 1, 2, 1, 1, 1, 2], [1, 1, 2], [0, 4]),
    ],
)
def test_searcher_non_overlapping_matches(
    prompt: list[int], pattern: list[int], expected: list[int]
) -> None:
    assert searcher_matches(prompt, pattern) == expected == naive_matches(prompt, pattern)


def test_searcher_first_match_at_or_after_start() -> None:
    prompt = [1, 2, 1, 2, 1, 2]
    searcher = TokenSearcher(prompt, [2, 1])
    assert searcher.find(0) == 1
    assert searcher.find(1) == 1  # the same answer again, without rescanning
    assert searcher.find(2) == 3  # overlapping occurrences are found when asked past the first
    assert searcher.find(5) is None
    assert searcher.find(6) is None


@given(
    prompt=st.lists(st.integers(1, 3), max_size=40),
    pattern=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    starts=st.lists(st.integers(0, 45), max_size=8),
)
def test_searcher_matches_naive_search(
    prompt: list[int], pattern: list[int], starts: list[int]
) -> None:
    assert searcher_matches(prompt, pattern) == naive_matches(prompt, pattern)
    searcher = TokenSearcher(prompt, pattern)
    for start in sorted(starts):
        expected = next(
            (i for i in range(start, len(prompt)) if prompt[i : i + len(pattern)] == pattern), None
        )
        assert searcher.find(start) == expected


def test_searcher_long_runs_use_slices() -> None:
    prompt = [7] * 5 + [IMG] * 3000 + [8] + [IMG] * 2999 + [9]
    (start, ops) = comparisons(TokenSearcher(prompt, [IMG] * 3000).find, 0)
    assert start == 5
    assert ops <= 2 * 3000


def test_searcher_builds_a_failure_table_only_after_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[Sequence[int]] = []
    borders = placeholders._borders
    monkeypatch.setattr(placeholders, "_borders", lambda p: (built.append(p), borders(p))[1])
    pattern = [VS, *[IMG] * 50, VE]
    # back-to-back exact occurrences: each query starts where the last match ended
    assert searcher_matches([1, *pattern, *pattern, 2], pattern) == [1, 53]
    assert built == []
    assert searcher_matches([VS, IMG, 5, *pattern], pattern) == [3]  # a partial match first
    assert built == [pattern]


def _borders_by_definition(pattern: Sequence[int]) -> list[int]:
    def longest(prefix: list[int]) -> int:  # the longest proper border of ``prefix``
        return max(b for b in range(len(prefix)) if prefix[:b] == prefix[len(prefix) - b :])

    return [longest(list(pattern[: q + 1])) for q in range(len(pattern))]


@pytest.mark.parametrize(
    "pattern",
    [
        [VS, *[IMG] * 40, VE],  # a unique start token: no borders, no loop
        [IMG] * 30,  # one token repeated: no loop
        [IMG],
        [VS, IMG, IMG, VS, IMG, IMG, VE],  # the general loop
        [IMG, IMG, VE, IMG, IMG, IMG],
    ],
)
def test_borders_equal_the_definition(pattern: list[int]) -> None:
    table, ops = placeholders._borders(pattern)
    assert table == _borders_by_definition(pattern)
    assert 0 < ops <= 2 * len(pattern)


@given(st.lists(st.integers(0, 2), min_size=1, max_size=24))
def test_borders_equal_the_definition_on_random_patterns(pattern: list[int]) -> None:
    assert placeholders._borders(pattern)[0] == _borders_by_definition(pattern)


# ------------------------------------------------------------------------- PlaceholderRange


def test_placeholder_range_embed_count_and_dict() -> None:
    plain = PlaceholderRange(offset=3, length=4)
    assert plain.embed_count == 4
    assert plain.to_dict() == {"offset": 3, "length": 4, "is_embed": None}
    masked = PlaceholderRange(1, 3, (False, True, False))
    assert masked.embed_count == 1
    assert json.loads(json.dumps(masked.to_dict())) == {
        "offset": 1,
        "length": 3,
        "is_embed": [False, True, False],
    }


def test_placeholder_range_rejects_mask_of_wrong_length() -> None:
    with pytest.raises(ValueError, match="is_embed has 2 entries for a range of 3 tokens"):
        PlaceholderRange(0, 3, (True, False))


# ---------------------------------------------------------------------- find_mm_placeholders

REPLACEMENTS = {
    "pattern_1": [IMG, IMG],
    "pattern_2": [],  # empty content is never found
    "pattern_3": [1550, 918, 1550],
    "pattern_4": [IMG],  # the same tokens as pattern_1: the earlier modality wins
}


@pytest.mark.parametrize("update_type", [PromptReplacement, PromptInsertion])
@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (
            [1, 9833, 28747, IMG, 9833, 28747, IMG, IMG, 918],
            {"pattern_1": [(6, 2)], "pattern_4": [(3, 1)]},
        ),
        (
            [1, IMG, IMG, 9833, 28747, IMG, IMG, 1550, 918, 1550],
            {"pattern_1": [(1, 2), (5, 2)], "pattern_3": [(7, 3)]},
        ),
        (
            [1, IMG, IMG, IMG, IMG, IMG, 1550, 918, 1550],
            {"pattern_1": [(1, 2), (3, 2)], "pattern_3": [(6, 3)], "pattern_4": [(5, 1)]},
        ),
    ],
)
def test_find_mm_placeholders(
    update_type: type[PromptReplacement] | type[PromptInsertion],
    prompt: list[int],
    expected: dict[str, list[tuple[int, int]]],
) -> None:
    updates = [update_type(key, [], repl) for key, repl in REPLACEMENTS.items()]
    result = find_mm_placeholders(prompt, updates, {key: 3 for key in REPLACEMENTS})
    assert {m: [(r.offset, r.length) for r in ranges] for m, ranges in result.items()} == expected


def test_find_mm_placeholders_carries_is_embed() -> None:
    content = PromptUpdateDetails.select_token_id([VS, IMG, IMG, VE], IMG)
    prompt = [1, VS, IMG, IMG, VE, 2, VS, IMG, IMG, VE]
    result = find_mm_placeholders(
        prompt, [PromptReplacement("image", [IMG], content)], {"image": 2}
    )
    mask = (False, True, True, False)
    assert result == {"image": [PlaceholderRange(1, 4, mask), PlaceholderRange(6, 4, mask)]}
    assert [r.embed_count for r in result["image"]] == [2, 2]


def test_find_mm_placeholders_per_item_content() -> None:
    update = PromptReplacement("image", [IMG], lambda i: [IMG] * (i + 1))
    prompt = [5, IMG, 6, IMG, IMG, 7, IMG, IMG, IMG]
    result = find_mm_placeholders(prompt, [update], {"image": 3})
    assert [(r.offset, r.length) for r in result["image"]] == [(1, 1), (3, 2), (6, 3)]


def test_find_mm_placeholders_first_alternative_wins_a_tie() -> None:
    updates = [PromptReplacement("image", [IMG], [IMG]), PromptInsertion("image", [], [IMG, IMG])]
    result = find_mm_placeholders([IMG, IMG], updates, {"image": 1})
    assert result == {"image": [PlaceholderRange(0, 1)]}


@pytest.mark.parametrize("prompt", [[], [1, 2, 3, 4, 5], [1, 998, 2]])
def test_missing_first_item_hides_later_items(prompt: list[int]) -> None:
    update = PromptReplacement("image", [0], lambda i: [999 - i])
    assert find_mm_placeholders(prompt, [update], {"image": 2}) == {}


def test_missing_item_hides_only_its_own_modality() -> None:
    updates = [
        PromptReplacement("image", [0], lambda i: [[50], [51]][i]),
        PromptReplacement("video", [0], [60]),
    ]
    prompt = [51, 60, 50, 1]  # image item 1 comes before item 0: only item 0 is found
    result = find_mm_placeholders(prompt, updates, {"image": 2, "video": 1})
    assert result == {"image": [PlaceholderRange(2, 1)], "video": [PlaceholderRange(1, 1)]}


def test_modality_without_items_is_absent() -> None:
    updates = [PromptReplacement("image", [0], [IMG]), PromptReplacement("video", [0], [60])]
    assert find_mm_placeholders([IMG, 60], updates, {"image": 1}) == {
        "image": [PlaceholderRange(0, 1)]
    }


@st.composite
def scan_cases(draw: st.DrawFn) -> tuple[list[int], dict[str, list[list[PromptUpdateDetails]]]]:
    prompt = draw(st.lists(st.integers(1, 3), max_size=30))
    seqs = st.lists(st.integers(1, 3), max_size=4)
    contents = {
        modality: [
            [
                PromptUpdateDetails.from_seq(seq)
                for seq in draw(st.lists(seqs, min_size=1, max_size=2))
            ]
            for _ in range(draw(st.integers(0, 3)))
        ]
        for modality in draw(st.lists(st.sampled_from("abc"), unique=True, max_size=3))
    }
    return prompt, contents


@given(scan_cases())
def test_find_placeholders_matches_one_position_at_a_time_scan(
    case: tuple[list[int], dict[str, list[list[PromptUpdateDetails]]]],
) -> None:
    prompt, contents = case
    assert find_placeholders(prompt, contents) == reference_find(prompt, contents)


# -------------------------------------------------------------------------------- complexity


def adversarial_find(n: int, k: int) -> tuple[dict[str, list[PlaceholderRange]], int]:
    """``[1]*(n-1) + [2]`` searched for ``[1]*k + [2]``: quadratic for a slice-per-position scan."""
    prompt = [1] * (n - 1) + [2]
    update = PromptReplacement("image", [2], [1] * k + [2])
    return comparisons(find_mm_placeholders, prompt, [update], {"image": 1})


@pytest.mark.parametrize("k", [1, 64, 1000])
def test_find_is_linear_on_adversarial_prompt(k: int) -> None:
    n = 30_000
    result, ops = adversarial_find(n, k)
    assert result == {"image": [PlaceholderRange(n - 1 - k, k + 1)]}
    assert ops <= 4 * n
    _, ops_doubled = adversarial_find(2 * n, k)
    assert ops_doubled <= 2.1 * ops


def test_find_is_linear_with_absent_and_frequent_false_prefix_candidates() -> None:
    prompt = [1] * 30_000
    updates = [
        PromptReplacement("absent", [0], [999, 0]),
        PromptReplacement("frequent_false_prefix", [0], [1, 2]),
    ]
    result, ops = comparisons(
        find_mm_placeholders, prompt, updates, {"absent": 1, "frequent_false_prefix": 1}
    )
    assert result == {}
    assert ops <= 4 * len(prompt)


def test_find_without_any_match_is_linear() -> None:
    prompt = list(range(10_000))
    result, ops = comparisons(
        find_mm_placeholders, prompt, [PromptReplacement("image", [0], [-1, -2])], {"image": 1}
    )
    assert result == {}
    assert ops <= 2 * len(prompt)


@pytest.mark.parametrize("num_items", [25, 100])
def test_find_many_items_is_linear(num_items: int) -> None:
    update = PromptReplacement("image", [IMG], lambda i: [IMG] * (1000 + i))
    prompt: list[int] = []
    for i in range(num_items):
        prompt += [5, 6, VS, *[IMG] * (1000 + i), VE]
    result, ops = comparisons(find_mm_placeholders, prompt, [update], {"image": num_items})
    assert len(result["image"]) == num_items
    assert ops <= 2 * len(prompt)
