"""bench/video_bench.py in smoke mode: HF's own PyAV loader and aiomm sample the same frames, and
the classic path's pixels equal HF's (the benchmark asserts both); no timing is asserted."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(
    ("model", "frames"),
    [("qwen2.5-vl", 4), ("qwen3-vl", 4), ("glm-4v", 2), ("glm-ocr", 6), ("glm-5-next", 2)],
)
def test_smoke_run_reports_every_path(
    capsys: pytest.CaptureFixture[str], model: str, frames: int
) -> None:
    """The timestamped prompts (Qwen3-VL, GLM-4V) are checked equal to HF's in the run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        bench = importlib.import_module("video_bench")
        report = bench.main(["--smoke", "--model", model])
    assert report["sampled_frames"] == frames
    paths = [k for k in report if k != "sampled_frames"]
    assert len(paths) == 3 and all(report[p]["videos_per_s"] > 0 for p in paths)
    assert "speed vs hf" in capsys.readouterr().out
