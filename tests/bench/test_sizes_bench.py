"""``aiomm bench --sizes``: a tiny run through the command line, and its workload.

No timing is asserted: speed is what the benchmark prints, side by side, in one run.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def sb() -> Iterator[SimpleNamespace]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        names = ("cli", "sizes")
        yield SimpleNamespace(**{n: importlib.import_module(f"stream_bench.{n}") for n in names})


def test_size_classes_mix_aspects_and_formats(sb: SimpleNamespace) -> None:
    sc = sb.sizes.make_class(300, 6, seed=0)
    assert max(max(s) for s in sc.shapes) == 300
    assert {"JPEG", "PNG"} == set(sc.formats)
    assert (225, 300) in sc.shapes and (300, 225) in sc.shapes  # photo, landscape and portrait
    assert any(270 <= h < 300 and w == 300 for h, w in sc.shapes)  # square-ish


def test_a_class_holds_enough_pixels_for_a_run_of_small_images(sb: SimpleNamespace) -> None:
    per = sb.sizes.images_per_class
    assert (per(512), per(1024), per(2048), per(4032)) == (256, 64, 24, 24)
    assert per(64) == 400  # bounded: the fixed cost probe has its own images
    tiny = sb.sizes.fixed_cost_images(4, seed=0)
    assert len(set(tiny)) == 4 and all(t[:2] == b"\xff\xd8" for t in tiny)  # distinct JPEGs


def test_tiny_sizes_run_reports_every_system_and_the_fast_mode(
    sb: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--sizes", "256,2400", "--per-class", "3", "--size-repeats", "1"]
    code = sb.cli.main([*argv, "--threads", "2", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    print(printed)
    record = json.loads((tmp_path / "sizes.json").read_text())
    assert [c["size"] for c in record["classes"]] == [256, 2400]
    for c in record["classes"]:
        assert set(c["systems"]) == {
            "aiomm float32",
            "aiomm uint8",
            "hf-threads",
            "floor (run)",
            "floor",
        }
        assert set(c["fast_jpeg"]) == {"exact", "fast"}  # the class's JPEGs alone, both modes
        for run in [*c["systems"].values(), *c["fast"].values(), *c["fast_jpeg"].values()]:
            assert run["images_per_s"] > 0 and run["cpu_ms_per_image"] > 0
        paired = c["uint8_per_floor_run"]  # each round's two runs, back to back
        assert len(paired["rounds"]) == 1 and paired["median"] == paired["rounds"][0] > 0
    fixed = record["fixed_cost"]  # the engine's own cost of a request, on 56-px JPEGs
    assert (fixed["edge"], fixed["requests"]) == (56, 3)
    assert fixed["images_per_s"] > 0 and fixed["cpu_ms_per_image"] > 0
    assert 0 < fixed["loop_cpu_ms_per_image"] <= fixed["cpu_ms_per_image"]
    small, large = record["classes"]
    # at 256 px nothing is reduced: fast equals exact; at 2400 px (4.3-5.8 MP, the budget is
    # 1 MP) the two JPEGs are reduced, close to exact (the PNG is not)
    assert small["quality"]["changed"] == 0
    assert small["quality"]["psnr_worst_db"] is None  # inf: JSON has none
    assert large["quality"]["changed"] == 2
    assert 40 < large["quality"]["psnr_worst_db"] < 100
    labels = (
        "aiomm float32",
        "aiomm uint8",
        "hf-threads",
        "floor",
        "fast mode",
        "PSNR",
        "JPEG only",
        "fixed cost per request",
        "aiomm uint8 / floor run, round by round",
    )
    for label in labels:
        assert label in printed


def test_vllm_job_is_a_workload_the_worker_reads(
    sb: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM cannot run in CI: check what its worker would be given (the worker's own reader)."""
    from stream_bench import workload
    from stream_bench.systems import vllm

    sc = sb.sizes.make_class(300, 3, seed=1)
    seen = {}

    def fake_run_vllm(job: dict, python: str, out: Path) -> dict:
        seen.update(job=job, python=python)
        wl = workload.load_workload(Path(job["workload"]))
        assert wl.data == sc.images  # the class's own bytes, one request each, in order
        assert [r.images for r in wl.requests] == [[0], [1], [2]]
        assert {r.prompt for r in wl.requests} == {sb.sizes.PROMPT}
        n = len(wl.requests)
        return {"status": "ok", "closed": {"images_per_s": 10.0, "cpu_s": 0.3, "images": n}}

    monkeypatch.setattr(vllm, "run_vllm", fake_run_vllm)
    run = sb.sizes.vllm_run(sc, "/venv/bin/python", tmp_path, threads=2, concurrency=4, seed=0)
    assert run.images_per_s == 10.0 and run.cpu_ms_per_image == pytest.approx(100.0)
    job = seen["job"]
    assert seen["python"] == "/venv/bin/python"
    assert job["concurrency"] == 4 and job["media_threads"] == 2 and job["requests"] == 3
    assert job["open_factors"] == [] and job["vllm_cache"] == "none"

    monkeypatch.setattr(vllm, "run_vllm", lambda *a: {"status": "failed", "reason": "no vllm"})
    assert sb.sizes.vllm_run(sc, "/x", tmp_path, threads=1, concurrency=1, seed=0) is None
