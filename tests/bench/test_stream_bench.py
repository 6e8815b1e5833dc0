"""The streaming benchmark end to end in quick mode, its workload, load generator, plot, child
processes and vLLM worker.

No timing is asserted: speed is what the benchmark prints, side by side, in one run.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import math
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from python_source import parse_file

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SYSTEMS = {"hf-sequential", "hf-threads", "vllm", "aiomm"}


@pytest.fixture(scope="module")
def sb() -> Iterator[SimpleNamespace]:
    """The ``stream_bench`` package's modules (bench/ is not installed: put on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        names = ("analysis", "cli", "jobs", "loadgen", "measure", "plot", "processors", "workload")
        modules = {name: importlib.import_module(f"stream_bench.{name}") for name in names}
        modules["aiomm"] = importlib.import_module("stream_bench.systems.aiomm")
        modules["vllm"] = importlib.import_module("stream_bench.systems.vllm")
        yield SimpleNamespace(**modules)


def test_quick_run_reports_every_system(
    sb: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = sb.cli.main(["--quick", "--out", str(tmp_path), "--window", "1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = json.loads((tmp_path / "stream_bench.json").read_text())
    png = (tmp_path / "stream_bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    assert set(results["systems"]) == SYSTEMS
    vllm = results["systems"]["vllm"]
    assert vllm["status"] == "skipped" and "--vllm-python" in vllm["reason"]
    workload = results["meta"]["workload"]
    for name in SYSTEMS - {"vllm"}:
        rec = results["systems"][name]
        assert rec["status"] == "ok", rec
        closed = rec["closed"]
        assert closed["completed"] == closed["requests"] == workload["requests"], closed
        assert closed["errors"] == 0 and closed["images"] == workload["images"]
        for key in ("images_per_s", "requests_per_s", "cpu_util", "rss_peak_mb"):
            assert closed[key] > 0, (name, key)
        lat = closed["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"], lat
        assert [r["mode"] for r in rec["open"]] == ["open"]
        assert rec["open"][0]["offered_rps"] > 0
    aiomm = results["systems"]["aiomm"]
    # a quarter of the image slots repeat an image: served by the cache or joined in flight
    assert aiomm["closed"]["cache_hits"] + aiomm["closed"]["cache_joins"] > 0
    assert aiomm["closed"]["engine"]["cache"]["misses"] == workload["unique_images"]
    assert [r["threads"] for r in aiomm["scaling"]][:2] == [1, 2]

    analysis = results["analysis"]
    ratios = analysis["ratios"]
    assert ratios["aiomm/hf-sequential"] > 0 and ratios["aiomm/hf-threads"] > 0
    assert ratios["aiomm/vllm"] is None
    assert analysis["floor_fraction"] > 0 and analysis["thread_speedup_2v1"] > 0
    assert {t["target"].split(" ")[0] for t in analysis["targets"]} >= {"aiomm", "outputs"}

    exact = results["checks"]["exact"]
    assert exact["exact"] is True and exact["max_norm_rel_err"] <= 1e-6
    assert all(r["pixels_equal"] and r["tokens_equal"] and r["uint8"] for r in exact["rows"])
    assert "exact: yes" in printed and "aiomm/x" in printed and "vllm" in printed
    assert "stream_bench.png" in printed


def test_workload_is_seeded_with_zipf_repeats(sb: SimpleNamespace, tmp_path: Path) -> None:
    w = sb.workload
    sizes = ((64, 48, 0.5), (80, 60, 0.5))
    spec = w.WorkloadSpec(seed=3, requests=40, repeat_share=0.25, sizes=sizes)
    first = w.load_workload(w.ensure_workload(spec, tmp_path / "a"))
    again = w.load_workload(w.ensure_workload(spec, tmp_path / "b"))
    assert first.manifest["requests"] == again.manifest["requests"]
    assert first.data == again.data
    slots = [k for r in first.requests for k in r.images]
    assert all(1 <= len(r.images) <= 4 for r in first.requests)
    assert len(slots) == first.manifest["slots"]
    unique = len(set(slots))
    assert unique == first.manifest["unique"] == len(first.data)
    assert abs((1 - unique / len(slots)) - 0.25) < 0.05
    counts = sorted((slots.count(k) for k in set(slots)), reverse=True)
    assert counts[0] >= 3 and counts[-1] == 1  # a few popular images, most seen once
    meta = first.manifest["images"]
    assert {(m["width"], m["height"]) for m in meta} <= {(w, h) for w, h, _ in sizes}
    assert {m["format"] for m in meta} <= {"JPEG", "PNG"}
    assert all(r.prompt.count(w.PLACEHOLDER) == len(r.images) for r in first.requests)


class _FakeServer:
    """Serves one request at a time after ``delay`` s; refuses (wait=False) when one is queued."""

    def __init__(self, loadgen: ModuleType, delay: float) -> None:
        self.loadgen, self.delay = loadgen, delay
        self.queued = 0

    async def submit(self, index: int, *, wait: bool) -> asyncio.Future[object] | None:
        if not wait and self.queued >= 2:
            return None
        self.queued += 1
        return asyncio.ensure_future(self._serve())

    async def _serve(self) -> object:
        from time import perf_counter

        await asyncio.sleep(self.delay * self.queued)
        self.queued -= 1
        return self.loadgen.Done(perf_counter(), images=2)


def test_load_generator_counts_rejected_and_unfinished(sb: SimpleNamespace) -> None:
    lg = sb.loadgen
    closed = asyncio.run(lg.closed_loop(_FakeServer(lg, 0.001), 10, 3))
    assert closed.completed == 10 and closed.images == 20 and len(closed.latencies) == 10
    arrivals = lg.arrival_times(seed=1, rate=2000.0, window=0.05, max_requests=50)
    assert arrivals == sorted(arrivals) and 0 < len(arrivals) <= 50
    assert lg.arrival_times(1, 1000.0, 10.0, 20) == [
        2 * t for t in lg.arrival_times(1, 2000.0, 5.0, 20)
    ]
    res = asyncio.run(lg.open_loop(_FakeServer(lg, 0.02), 4, arrivals, 0.0))
    assert res.rejected > 0 and res.offered == len(arrivals)
    assert res.completed + res.rejected + res.unfinished + res.errors == len(arrivals)
    assert len(res.unfinished_ages) == res.unfinished


@pytest.mark.parametrize("n", [1, 2, 7, 100, 101])
def test_percentiles_are_nearest_rank(sb: SimpleNamespace, n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    qs = (1, 50, 90, 99, 100)

    def nearest_rank(q: float) -> float:
        data = sorted(values)
        return data[max(1, math.ceil(q / 100 * len(data))) - 1]

    got = sb.measure.percentiles(values, qs)
    assert got == [nearest_rank(q) for q in qs], (n, got)
    assert set(got) <= set(values)  # every percentile is an observed latency
    assert all(math.isnan(v) for v in sb.measure.percentiles([], qs))


def _results_with_sweep() -> dict[str, object]:
    def run(rps: float, p50: float, p99: float) -> dict[str, object]:
        return {"offered_rps": rps, "latency_ms": {"p50": p50, "p99": p99}}

    return {
        "systems": {
            "aiomm": {
                "status": "ok",
                "closed": {"images_per_s": 50.0},
                "open": [run(1.0, 100.0, 300.0), run(2.0, 150.0, 900.0)],
                "scaling": [
                    {"threads": 1, "images_per_s": 30.0},
                    {"threads": 2, "images_per_s": 52.0},
                ],
            },
            "hf-threads": {
                "status": "ok",
                "closed": {"images_per_s": 25.0},
                "open": [run(0.5, 400.0, float("nan"))],
            },
            "vllm": {"status": "skipped", "reason": "no --vllm-python"},
        },
        "checks": {"floor": {"floor_s": 1.0, "images_per_s": 100.0, "cores": 2}},
        "sweep": {
            "status": "ok",
            "grid": [
                {"threads": t, "max_in_flight": m, "images_per_s": 10.0 * t + m}
                for t in (1, 2)
                for m in (2, 8)
            ],
        },
    }


def test_plot_draws_three_panels_with_the_sweep(sb: SimpleNamespace, tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "stream_bench.png"
    results = _results_with_sweep()
    sb.plot.plot(results, path)
    with Image.open(path) as image:
        three = image.size
    results.pop("sweep")
    sb.plot.plot(results, path)
    with Image.open(path) as image:
        two = image.size
    assert three[1] == two[1] and three[0] > two[0] * 1.4, (three, two)


def test_plot_without_matplotlib_names_the_extra(
    sb: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    with pytest.raises(sb.plot.PlotUnavailableError, match=r"\.\[bench\]"):
        sb.plot.plot(_results_with_sweep(), tmp_path / "stream_bench.png")
    assert not (tmp_path / "stream_bench.png").exists()


def test_isolated_jobs_run_in_a_child_from_the_checkout_root(
    sb: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the child is `python bench/stream_bench --child JOB`; started from the checkout's root,
    # whose kernels/ must not shadow Hugging Face's `kernels` when transformers loads
    monkeypatch.chdir(REPO)
    w = sb.workload
    spec = w.WorkloadSpec(seed=5, requests=3, sizes=((64, 48, 0.5), (96, 64, 0.5)))
    folder = w.ensure_workload(spec, tmp_path / "workload")
    job = {"kind": "checks", "workload": str(folder), "requests": 3, "loop": "asyncio"}
    rec = sb.jobs.run_job({**job, "exact_requests": [0, 1]}, tmp_path, True, "checks")
    assert rec["status"] == "ok", rec
    assert rec["exact"]["exact"] is True and rec["exact"]["requests"] == 2, rec["exact"]
    assert rec["floor"]["unique_images"] > 0 and rec["floor"]["images_per_s"] > 0
    assert json.loads((tmp_path / "jobs" / "checks.result.json").read_text()) == rec

    # a bad job comes back as a failed record naming what was wrong, not as an exception
    bad = sb.jobs.execute({"kind": "nonsense"})
    assert bad["status"] == "failed" and "unknown job kind 'nonsense'" in bad["reason"], bad


def test_vllm_worker_imports_only_vllm_stdlib_pillow_numpy() -> None:
    allowed = set(sys.stdlib_module_names) | {"vllm", "PIL", "numpy", "stream_bench", "__future__"}
    tree = parse_file(BENCH / "_vllm_worker.py")
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= allowed, imported - allowed
    # and what it loads of stream_bench at import time needs nothing of aiomm's environment
    probe = "import sys, _vllm_worker; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=BENCH, capture_output=True, text=True, check=True
    ).stdout
    loaded = set(ast.literal_eval(out.strip().splitlines()[-1]))
    assert loaded.isdisjoint({"aiomm", "torch", "transformers", "matplotlib", "vllm"}), loaded
    assert "stream_bench" in loaded


def test_vllm_model_folder_holds_the_reference_processor(
    sb: SimpleNamespace, tmp_path: Path
) -> None:
    from transformers import AutoProcessor

    folder = sb.vllm.write_vllm_model_dir(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    loaded = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    reference = sb.processors.hf_processor()
    assert config["image_token_id"] == loaded.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompt = sb.workload.prompt_for(2, "describe the image")
    assert loaded.tokenizer(prompt)["input_ids"] == reference.tokenizer(prompt)["input_ids"]
    for key in ("size", "patch_size", "merge_size", "image_mean", "image_std", "resample"):
        assert getattr(loaded.image_processor, key) == getattr(reference.image_processor, key)


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "--quick", "--help"]])
def test_aiomm_bench_subcommand_reaches_the_benchmark(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from aiomm.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--vllm-python" in out and "--sweep" in out and "--quick" in out


def test_thread_scaling_keeps_the_best_of_interleaved_runs(sb: SimpleNamespace) -> None:
    runs = {
        1: [{"threads": 1, "images_per_s": 30.0}, {"threads": 1, "images_per_s": 24.0}],
        2: [{"threads": 2, "images_per_s": 48.0}, {"threads": 2, "images_per_s": 53.0}],
    }
    best = sb.aiomm.best_runs(runs)
    assert [(r["threads"], r["images_per_s"]) for r in best] == [(1, 30.0), (2, 53.0)]
    assert best[1]["runs_images_per_s"] == [48.0, 53.0]
    assert "runs_images_per_s" not in runs[2][1]  # the records themselves are left alone
