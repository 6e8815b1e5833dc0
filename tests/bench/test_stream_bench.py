"""The streaming benchmark end to end in quick mode, its workload, load generator and vLLM worker.

No timing is asserted: speed is what the benchmark prints, side by side, in one run.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SYSTEMS = {"hf-sequential", "hf-threads", "vllm", "aiomm"}


@pytest.fixture(scope="module")
def sb() -> ModuleType:
    """``bench/stream_bench.py`` by path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("aiomm_stream_bench", BENCH / "stream_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_every_system(
    sb: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = sb.main(["--quick", "--out", str(tmp_path), "--window", "1"])
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
        assert closed["latency_ms"]["p50"] <= closed["latency_ms"]["p99"]
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


def test_workload_is_seeded_with_zipf_repeats(sb: ModuleType, tmp_path: Path) -> None:
    sizes = ((64, 48, 0.5), (80, 60, 0.5))
    spec = sb.WorkloadSpec(seed=3, requests=40, repeat_share=0.25, sizes=sizes)
    first = sb.load_workload(sb.ensure_workload(spec, tmp_path / "a"))
    again = sb.load_workload(sb.ensure_workload(spec, tmp_path / "b"))
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
    assert all(r.prompt.count(sb.PLACEHOLDER) == len(r.images) for r in first.requests)


class _FakeServer:
    """Serves one request at a time after ``delay`` s; refuses (wait=False) when one is queued."""

    def __init__(self, sb: ModuleType, delay: float) -> None:
        self.sb, self.delay = sb, delay
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
        return self.sb.Done(perf_counter(), images=2)


def test_load_generator_counts_rejected_and_unfinished(sb: ModuleType) -> None:
    closed = asyncio.run(sb.closed_loop(_FakeServer(sb, 0.001), 10, 3))
    assert closed.completed == 10 and closed.images == 20 and len(closed.latencies) == 10
    arrivals = sb.arrival_times(seed=1, rate=2000.0, window=0.05, max_requests=50)
    assert arrivals == sorted(arrivals) and 0 < len(arrivals) <= 50
    assert sb.arrival_times(1, 1000.0, 10.0, 20) == [
        2 * t for t in sb.arrival_times(1, 2000.0, 5.0, 20)
    ]
    res = asyncio.run(sb.open_loop(_FakeServer(sb, 0.02), 4, arrivals, 0.0))
    assert res.rejected > 0 and res.offered == len(arrivals)
    assert res.completed + res.rejected + res.unfinished + res.errors == len(arrivals)
    assert len(res.unfinished_ages) == res.unfinished


def test_vllm_worker_imports_only_vllm_stdlib_pillow_numpy() -> None:
    allowed = set(sys.stdlib_module_names) | {"vllm", "PIL", "numpy", "stream_bench", "__future__"}
    tree = ast.parse((BENCH / "_vllm_worker.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= allowed, imported - allowed
    # and stream_bench itself imports only the standard library at import time
    bench = ast.parse((BENCH / "stream_bench.py").read_text())
    top = {
        alias.name.split(".")[0]
        for node in bench.body
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module.split(".")[0] for node in bench.body if isinstance(node, ast.ImportFrom)}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


def test_vllm_model_folder_holds_the_reference_processor(sb: ModuleType, tmp_path: Path) -> None:
    from transformers import AutoProcessor

    folder = sb.write_vllm_model_dir(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    loaded = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    reference = sb._hf_processor()
    assert config["image_token_id"] == loaded.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompt = sb.prompt_for(2, "describe the image")
    assert loaded.tokenizer(prompt)["input_ids"] == reference.tokenizer(prompt)["input_ids"]
    for key in ("size", "patch_size", "merge_size", "image_mean", "image_std", "resample"):
        assert getattr(loaded.image_processor, key) == getattr(reference.image_processor, key)


def test_aiomm_bench_subcommand_reaches_the_benchmark(capsys) -> None:
    from aiomm.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "--vllm-python" in capsys.readouterr().out


def test_thread_scaling_keeps_the_best_of_interleaved_runs(sb: ModuleType) -> None:
    runs = {
        1: [{"threads": 1, "images_per_s": 30.0}, {"threads": 1, "images_per_s": 24.0}],
        2: [{"threads": 2, "images_per_s": 48.0}, {"threads": 2, "images_per_s": 53.0}],
    }
    best = sb.best_runs(runs)
    assert [(r["threads"], r["images_per_s"]) for r in best] == [(1, 30.0), (2, 53.0)]
    assert best[1]["runs_images_per_s"] == [48.0, 53.0]
    assert "runs_images_per_s" not in runs[2][1]  # the records themselves are left alone
