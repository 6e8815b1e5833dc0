"""bench/audio_bench.py in smoke mode: aiomm's decode equals vLLM's and its features HF's (the
benchmark asserts both before timing); no timing is asserted."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_smoke_run_reports_every_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        bench = importlib.import_module("audio_bench")
        report = bench.main(["--smoke", "--threads", "1"])
    assert report["clips"] == 2 and report["audio_seconds"] == pytest.approx(31.5)
    for path in (
        "features hf",
        "features aiomm",
        "decode+features vllm/hf",
        "decode+features aiomm",
    ):
        assert report[path]["cpu_ms_per_audio_s"] > 0 and report[path]["clips_per_s"] > 0
    assert "speed vs hf" in capsys.readouterr().out
