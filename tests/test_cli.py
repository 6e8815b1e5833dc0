"""``aiomm run`` for every registered architecture: the prompt comes from the adapter itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aiomm.adapters import supported_adapters
from aiomm.cli import main
from aiomm.media.samples import encode, photo_like


@pytest.fixture(autouse=True)
def _restore_aiomm_logging() -> Iterator[None]:
    """``main`` configures the ``aiomm`` logger as a program does: undo it for the tests after."""
    logger = logging.getLogger("aiomm")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    for handler in list(logger.handlers):
        if handler not in handlers:
            logger.removeHandler(handler)


def _photo(folder: Path) -> Path:
    image = folder / "photo.jpg"
    image.write_bytes(encode(photo_like(np.random.default_rng(0), 90, 120), "JPEG"))
    return image


@pytest.mark.parametrize("name", [info.short_name for info in supported_adapters()])
def test_run_an_image_with_every_model(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = _photo(tmp_path)
    output = tmp_path / "out.jsonl"
    argv = ["run", str(image), "--model", name, "--no-progress", "--output", str(output)]
    code = main([*argv, "--allowed-root", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "nan" not in printed and "(0 failed)" in printed
    (line,) = output.read_text().splitlines()
    record = json.loads(line)
    assert record["ok"] and record["placeholders"]["image"][0][1] > 0
    assert record["tensors"]["pixel_values"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", [info.short_name for info in supported_adapters()])
def test_plan_an_image_with_every_model(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = _photo(tmp_path)
    rows = []
    for plan in (False, True):
        output = tmp_path / f"out-{plan}.jsonl"
        argv = ["run", str(image), "--model", name, "--no-progress", "--output", str(output)]
        code = main([*argv, "--allowed-root", str(tmp_path), *(["--plan"] if plan else [])])
        assert code == 0, capsys.readouterr().out
        (line,) = output.read_text().splitlines()
        rows.append(json.loads(line))
    full, planned = rows
    assert planned["ok"] and planned["tensors"] == {}
    assert planned["num_tokens"] == full["num_tokens"]
    assert planned["placeholders"] == full["placeholders"]


def test_summary_of_failed_requests_prints_no_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    output = tmp_path / "out.jsonl"
    argv = ["run", str(bad), "--no-progress", "--output", str(output)]
    code = main([*argv, "--allowed-root", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 1
    assert "nan" not in printed and "(1 failed)" in printed and "DecodeError" in printed
    # the error names the item's source, in the summary and in its row
    (line,) = [line for line in printed.splitlines() if "DecodeError" in line]
    assert f"(source: {bad})" in line
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert row["sources"] == [str(bad)] and f"(source: {bad})" in row["error"]


def test_embedded_defaults_write_into_the_working_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--samples", "2", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "each sample image is sent twice to show the cache" in printed
    assert "qwen2-vl" in printed and "cpu" in printed
    lines = (tmp_path / "aiomm-results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 4 and all(r["ok"] for r in rows)
    assert [r["sources"] for r in rows[:2]] == [r["sources"] for r in rows[2:]]


def test_sources_are_shown_without_credentials_or_payloads() -> None:
    from aiomm.cli import _shown

    assert "secret" not in _shown("https://user:secret@example.com/a.jpg")
    assert len(_shown("data:image/png;base64," + "A" * 1000)) < 50
    assert _shown(Path("a/b.jpg")) == "a/b.jpg"


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "x.jpg", "--allowed-media-domains", "https://example.com/"],
        ["serve", "qwen2-vl", "--allowed-media-domains", "example.com:80"],
    ],
)
def test_a_bad_domain_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert len((captured.out + captured.err).strip().splitlines()) == 1
    assert "is not a host name" in captured.err
