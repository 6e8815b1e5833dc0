"""The error tree: the docstring is the hierarchy, context travels with the error, pickling."""

from __future__ import annotations

import builtins
import pickle
import re

import pytest

import aiomm
from aiomm import errors
from aiomm.errors import (
    AiommError,
    AspectRatioError,
    ConfigError,
    EmptyResizeError,
    FetchError,
    HTTPStatusError,
    InvalidRequestError,
    ItemCountMismatchError,
    ItemRejectedError,
    MediaError,
    ProcessingError,
    TooFewFramesError,
    UnknownArchitectureError,
    UnknownModalityError,
)
from aiomm.types import Request


def _tree() -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """The docstring's tree as ``{class: (parent, builtins named in parentheses)}``."""
    doc = errors.__doc__ or ""
    lines = doc.split("::", 1)[1].strip("\n").splitlines()
    parsed: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    stack: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        match = re.match(r"^\s*(?P<prefix>(?:│   |    )*)(?:[├└]── )?(?P<name>[A-Z]\w+)", line)
        assert match, line
        depth = 0 if "──" not in line else len(match["prefix"]) // 4 + 1
        bases = re.match(r"^\s*[│├└─ ]*\w+ \((\w+)\)", line)
        del stack[depth:]
        parsed[match["name"]] = (stack[-1] if stack else None, (bases[1],) if bases else ())
        stack.append(match["name"])
    return parsed


#: the exception classes (``errors`` also exports ``first_error``, a helper)
ERROR_NAMES = {name for name in errors.__all__ if name[0].isupper()}


def test_docstring_tree_is_the_class_hierarchy() -> None:
    tree = _tree()
    assert set(tree) == ERROR_NAMES
    for name, (parent, builtin_names) in tree.items():
        cls = getattr(errors, name)
        aiomm_bases = [b.__name__ for b in cls.__bases__ if issubclass(b, AiommError)]
        if parent is None:
            assert cls is AiommError
            continue
        assert aiomm_bases == [parent], f"{name}: tree says {parent}, class has {aiomm_bases}"
        # the builtin a class adds itself is named in the tree, and only that one
        own = [b for b in cls.__bases__ if not issubclass(b, AiommError)]
        assert [b.__name__ for b in own] == list(builtin_names), name
        assert all(getattr(builtins, b.__name__) is b for b in own), name


def test_every_error_is_exported_from_the_package() -> None:
    for name in ERROR_NAMES:
        assert getattr(aiomm, name) is getattr(errors, name)
        assert name in aiomm.__all__


def test_context_is_shown_and_attached_after_the_fact() -> None:
    err = FetchError("no such file", source="a.png")
    assert str(err) == "no such file (source: a.png)"
    assert err.request_id is None and err.item_index is None
    assert err.with_context(item_index=2) is err
    assert err.with_context(request_id="r7") is err
    # the outer layer's request_id does not erase the inner layer's item_index
    assert (err.request_id, err.item_index) == ("r7", 2)
    assert str(err) == "no such file (source: a.png) [request_id='r7', item_index=2]"
    assert err.message == "no such file (source: a.png)"


def test_context_keywords_at_construction() -> None:
    err = AiommError("boom", request_id="r1", item_index=0)
    assert str(err) == "boom [request_id='r1', item_index=0]"
    assert str(MediaError("bad", request_id="r2")) == "bad [request_id='r2']"
    with pytest.raises(TypeError):
        AiommError("boom", "r1", 0, 1, bogus=1)  # type: ignore[call-arg]


def test_field_errors_take_context_too() -> None:
    err = ItemCountMismatchError("image", 2, 1).with_context(request_id="r3")
    assert str(err).startswith("the request has 2 image item(s) but the prompt has 1")
    assert str(err).endswith("[request_id='r3']")
    unknown = UnknownArchitectureError("Foo", ["b", "a"]).with_context(request_id="r4")
    assert str(unknown) == "unknown architecture 'Foo'; supported: a, b [request_id='r4']"
    assert unknown.args == ("Foo",) and isinstance(unknown, KeyError)


def test_http_status_error_is_built_from_fields() -> None:
    err = HTTPStatusError(404, "https://example.com/a.png", item_index=1)
    assert (err.status_code, err.url, err.source) == (404, "https://example.com/a.png", err.url)
    assert (
        str(err) == "HTTP status 404 Not Found (source: https://example.com/a.png) [item_index=1]"
    )
    assert str(HTTPStatusError(599)) == "HTTP status 599"
    assert isinstance(err, FetchError) and isinstance(err, ValueError)


@pytest.mark.parametrize(
    "err",
    [
        AiommError("plain"),
        ConfigError("EngineConfig.max_in_flight must be an integer >= 1, got 0 (int)"),
        HTTPStatusError(503, "http://h/x"),
        FetchError("no such file", source="x.png"),
        UnknownModalityError("audio", ["image"]),
        ItemCountMismatchError("image", 1, 2),
        UnknownArchitectureError("Foo", ["Bar"]),
        AspectRatioError("image", 8, 2000, ratio=250.0),
        EmptyResizeError("image", 1, 2500, (0, 1540)),
        TooFewFramesError(1, 2),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_fields_and_context(err: AiommError) -> None:
    # results travel between processes (host buffer pool, workers); so do their errors
    err.with_context(request_id="r9", item_index=3)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err)
    assert str(copy) == str(err) and copy.args == err.args
    assert vars(copy) == vars(err)


def test_refused_items_name_what_was_wrong() -> None:
    """The processor's refusals of an item: processing errors whose fields and message say
    which kind of item and what about it (the engine adds which item)."""
    thin = AspectRatioError("video", 4, 840, ratio=210.0).with_context(item_index=1)
    assert (thin.modality, thin.height, thin.width, thin.ratio, thin.limit) == (
        "video", 4, 840, 210.0, 200,
    )  # fmt: skip
    assert str(thin) == (
        "the model's processor refuses this video: a video of 4x840 frames (height x width) "
        "has an aspect ratio of 210, above the limit of 200 [item_index=1]"
    )
    empty = EmptyResizeError("image", 1, 2500, (0, 1540))
    assert empty.message == (
        "the model's processor refuses this image: a 1x2500 image (height x width) would be "
        "resized to 0x1540, a side of no pixels"
    )
    short = TooFewFramesError(1, 2)
    assert (short.modality, short.frames, short.minimum) == ("video", 1, 2)
    assert "a video of 1 sampled frame(s) is shorter than temporal_patch_size 2" in str(short)
    for err in (thin, empty, short):
        assert isinstance(err, ItemRejectedError) and isinstance(err, ProcessingError)
        assert isinstance(err, ValueError)


def test_bad_request_raises_invalid_request_error() -> None:
    with pytest.raises(
        InvalidRequestError, match="exactly one of prompt_token_ids and prompt, got neither"
    ) as info:
        Request(request_id="r1")
    assert info.value.request_id == "r1" and isinstance(info.value, ValueError)
    with pytest.raises(InvalidRequestError, match="got both"):
        Request(prompt="x", prompt_token_ids=[1])
    with pytest.raises(InvalidRequestError, match="image_hashes has 1 entries for 2 images"):
        Request(prompt="x", images=[b"a", b"b"], image_hashes=["h"])
    with pytest.raises(InvalidRequestError, match="single str; wrap it in a list"):
        Request(prompt="x", images="https://example.com/a.png")
    assert Request(prompt_token_ids=[1, 2], images=[b"a"], image_hashes=[None]).images == [b"a"]
