"""``aiomm run`` for every registered architecture: the prompt comes from the adapter itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aiomm.adapters import supported_adapters
from aiomm.cli import main
from aiomm.media.samples import encode, photo_like


@pytest.mark.parametrize("name", [info.short_name for info in supported_adapters()])
def test_run_an_image_with_every_model(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "photo.jpg"
    image.write_bytes(encode(photo_like(np.random.default_rng(0), 90, 120), "JPEG"))
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
