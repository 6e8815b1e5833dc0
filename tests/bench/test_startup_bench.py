"""bench/startup_bench.py: a fresh process per timing, every phase reported (no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "startup_bench.py"


def test_one_run_reports_every_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("startup_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--runs", "1", "--json", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "s.json").read_text())
    median = record["median_s"]
    assert all(median[p] >= 0 for p in module.PHASES)
    # the phases add up to the time from spawn to the first result
    assert sum(median[p] for p in module.PHASES) == pytest.approx(median["first_result"])
    # two separate processes: on a loaded machine either may finish first, so only both are timed
    assert record["aiomm_run_samples_1_s"] > 0 and record["aiomm_run_first_result_s"] > 0
    assert len(record["all"]["cli"]) == len(record["all"]["cli_first"]) == 1
    # the embedded default starts from its stored snapshot: no transformers, no torchvision
    assert not {"transformers", "torchvision"} & set(record["loaded"] + record["aiomm_run_loaded"])
    assert "spawn -> first result" in printed and "aiomm run --samples 1: first" in printed


def test_another_architecture_starts_from_its_snapshot(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("startup_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = module.phases_once(model="gemma3")
    assert record["first_result"] > 0
    assert not {"transformers", "torchvision"} & set(record["loaded"])
