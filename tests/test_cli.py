"""``aiomm run`` for every registered architecture: the prompt comes from the adapter itself
(images for the architectures that take them, audio clips for an audio one)."""

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


#: the architectures that take images, and those that take only audio
IMAGE_MODELS = [
    i.short_name for i in supported_adapters() if "image" in i.processor_cls.supported_modalities
]
AUDIO_MODELS = [i.short_name for i in supported_adapters() if i.short_name not in IMAGE_MODELS]


def _photo(folder: Path) -> Path:
    image = folder / "photo.jpg"
    image.write_bytes(encode(photo_like(np.random.default_rng(0), 90, 120), "JPEG"))
    return image


@pytest.mark.parametrize("name", IMAGE_MODELS)
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


@pytest.mark.parametrize("name", IMAGE_MODELS)
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


@pytest.mark.parametrize("name", AUDIO_MODELS)
def test_run_and_plan_audio_with_every_audio_model(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from audio_samples import CASES
    from audio_samples import encode as encode_audio

    folder = tmp_path / "clips"
    folder.mkdir()
    for case in (CASES[0], CASES[8], CASES[10]):  # WAV, FLAC, MP3
        (folder / f"{case.name}.{case.fmt.lower()}").write_bytes(encode_audio(case))
    (folder / "notes.txt").write_text("not audio: skipped")
    rows = []
    for plan in (False, True):
        output = tmp_path / f"out-{plan}.jsonl"
        argv = ["run", str(folder), "--model", name, "--no-progress", "--output", str(output)]
        argv += ["--items-per-request", "2", "--allowed-root", str(tmp_path)]
        code = main([*argv, *(["--plan"] if plan else [])])
        printed = capsys.readouterr().out
        assert code == 0, printed
        assert "audios/s" in printed and "(0 failed)" in printed
        rows.append([json.loads(line) for line in output.read_text().splitlines()])
    full, planned = rows
    assert [len(r["sources"]) for r in full] == [2, 1]
    assert all(len(r["placeholders"]["audio"]) == len(r["sources"]) for r in full)
    assert full[0]["tensors"]["input_features"]["dtype"] == "float32"
    for f, p in zip(full, planned, strict=True):
        assert p["tensors"] == {} and p["placeholders"] == f["placeholders"]


@pytest.mark.parametrize("name", AUDIO_MODELS)
def test_embedded_sample_clips_for_an_audio_model(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--model", name, "--samples", "3", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "each sample clip is sent twice" in printed
    rows = [
        json.loads(line) for line in (tmp_path / "aiomm-results.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 6 and all(r["ok"] and r["placeholders"]["audio"] for r in rows)
    # the second pass is served by the cache (a hit, or joined while the first computes); rows
    # come as they finish, and clips of different lengths finish out of order
    assert sum(r["cache"][0] in ("hit", "joined") for r in rows) == 3


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


def test_serve_passes_the_per_request_item_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiomm.server.serve as serve_module

    seen: dict[str, object] = {}

    def fake_serve(config: object, **kwargs: object) -> int:
        seen["limits"] = config.limits  # type: ignore[attr-defined]
        return 0

    monkeypatch.setattr(serve_module, "serve", fake_serve)
    monkeypatch.setattr("aiomm.logging.configure_logging", lambda **kwargs: None)
    argv = ["serve", "qwen2-audio", "--max-images", "3", "--max-videos", "1", "--max-audios", "2"]
    assert main(argv) == 0
    limits = seen["limits"]
    assert (limits.max_images, limits.max_videos, limits.max_audios) == (3, 1, 2)  # type: ignore[attr-defined]
