"""``bench/family_bench.py``: its workload, prompts, round order and report (hf and aiomm only).

No timing is asserted: speed is what the benchmark prints, side by side, in one run. vLLM's
system needs a vLLM environment and is left out here (reported as skipped).
"""

from __future__ import annotations

import importlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import PIL.Image
import pytest

from aiomm.adapters import get_adapter_info

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = ["--sizes", "64x48,96x72", "--large", "none"]


@pytest.fixture(scope="module")
def fb() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        yield importlib.import_module("family_bench")


def test_smoke_run_reports_hf_and_aiomm_side_by_side(
    fb: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    argv = ["--models", "qwen2-vl", "--n", "3", "--rounds", "2", *TINY, "--json", str(out)]
    report = fb.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    settings = report["settings"]
    assert settings["threads"] == 2 and settings["rounds"] == 2 and settings["requests"] == 3
    (name,) = report["architectures"]
    record = report["architectures"][name]
    assert name == "qwen2-vl" and record["architecture"] == "Qwen2VLForConditionalGeneration"
    systems = record["systems"]
    assert systems["vllm"] == {"status": "skipped", "reason": "no --vllm-venv given"}
    for system, dtype in (("hf", "float32"), ("aiomm", "uint8")):
        rec = systems[system]
        assert rec["status"] == "ok", rec
        assert rec["pixel_dtype"] == dtype  # aiomm leaves Qwen2-VL's normalisation to the device
        assert len(rec["rounds"]) == 2 and rec["images"] == 2 * settings["images_per_round"]
        assert rec["images_per_s"] > 0 and rec["cpu_ms_per_image"] > 0
        assert len(rec["round_images_per_s"]) == 2 and len(rec["warmup_rounds"]) == 1
    # the same requests: aiomm expands the prompts to HF's token count
    assert systems["aiomm"]["prompt_tokens"] == systems["hf"]["prompt_tokens"] > 0
    ratios = record["ratios"]
    assert set(ratios) == {
        "cpu_per_image_aiomm_over_hf",
        "cpu_per_image_median_aiomm_over_hf",
        "images_per_s_aiomm_over_hf",
    }
    expected = systems["aiomm"]["cpu_ms_per_image"] / systems["hf"]["cpu_ms_per_image"]
    assert ratios["cpu_per_image_aiomm_over_hf"] == pytest.approx(expected)

    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("qwen2-vl (Qwen2VLForConditionalGeneration): 3 requests")
    assert "1 warm-up + 2 ABBA rounds, 2 threads each (torch and pool)" in printed[0]
    assert printed[1].split()[:3] == ["system", "images/s", "CPU"]
    rows = {line.split()[0]: line.split() for line in printed[2:5]}
    assert rows["hf"][5] == "float32" and rows["aiomm"][5] == "uint8"
    assert float(rows["aiomm"][2]) == pytest.approx(systems["aiomm"]["cpu_ms_per_image"], abs=0.05)
    assert rows["vllm"][1:] == ["skipped:", "no", "--vllm-venv", "given"]
    assert printed[5].startswith("aiomm/hf CPU per image x")
    # the closing Markdown table: a row per architecture
    assert printed[-3].startswith("| architecture | hf images/s (CPU ms/img) | aiomm | vllm |")
    cells = [c.strip() for c in printed[-1].strip("|").split("|")]
    assert cells[0] == "qwen2-vl" and cells[3] == "skipped" and cells[5] == "-"
    assert (
        cells[1] == f"{systems['hf']['images_per_s']:.2f} ({systems['hf']['cpu_ms_per_image']:.1f})"
    )
    assert float(cells[4]) == pytest.approx(ratios["cpu_per_image_aiomm_over_hf"], abs=0.005)


def test_a_system_that_cannot_start_is_reported_and_the_others_run(
    fb: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # Llama Nemotron VL has no HF processor: its reference is a parameter holder
    argv = ["--models", "llama-nemotron-vl-embed", "--n", "1", "--rounds", "1", "--warmup", "0"]
    argv += TINY
    systems = fb.main(argv)["architectures"]["llama-nemotron-vl-embed"]["systems"]
    assert systems["hf"]["status"] == "failed" and "not callable" in systems["hf"]["reason"]
    assert systems["aiomm"]["status"] == "ok" and systems["aiomm"]["images_per_s"] > 0
    assert systems["aiomm"]["warmup_rounds"] == []
    printed = capsys.readouterr().out
    assert "hf       failed: TypeError" in printed
    assert "no ratio: aiomm and another system not both measured" in printed


def test_workload_is_seeded_with_one_to_three_images_and_one_large(fb: ModuleType) -> None:
    sizes = [(40, 30), (24, 18)]
    wl = fb.make_workload(9, 3, sizes, (80, 60))
    assert wl == fb.make_workload(9, 3, sizes, (80, 60))
    assert wl.images != fb.make_workload(9, 4, sizes, (80, 60)).images
    assert len(wl.requests) == 9 and all(1 <= len(r) <= 3 for r in wl.requests)
    flat = [k for r in wl.requests for k in r]
    assert flat == list(range(len(wl.images))) == list(range(wl.image_count))
    assert wl.sizes.count((80, 60)) == 1 and set(wl.sizes) <= {*sizes, (80, 60)}
    for data, size in zip(wl.images, wl.sizes, strict=True):
        image = PIL.Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.size == size
    assert (80, 60) not in fb.make_workload(9, 3, sizes, None).sizes


@pytest.mark.parametrize("name", ["qwen2-vl", "glm-4v", "mistral3"])
def test_prompts_hold_one_family_placeholder_per_image(fb: ModuleType, name: str) -> None:
    hf = get_adapter_info(name).build_hf_processor(backend="torchvision")
    prompts = fb.render_prompts(hf, [1, 2, 3])
    for k, prompt in prompts.items():
        assert prompt.count(hf.image_token) == k, prompt
        assert fb.TEXT in prompt and prompt.count("and ") == k - 1  # a word after each image


def test_rounds_alternate_the_order_of_the_systems(fb: ModuleType) -> None:
    assert fb.abba(["hf", "aiomm", "vllm"], 3) == [
        ["hf", "aiomm", "vllm"],
        ["vllm", "aiomm", "hf"],
        ["hf", "aiomm", "vllm"],
    ]


def test_summary_sums_the_rounds_and_takes_the_median_round(fb: ModuleType) -> None:
    def round_of(wall: float, cpu: float, system: float) -> dict[str, float]:
        return {"wall_s": wall, "cpu_s": cpu, "system_cpu_s": system, "images": 10,
                "prompt_tokens": 50}  # fmt: skip

    summary = fb.summarise([round_of(2.0, 3.0, 1.0), round_of(3.0, 2.0, 0.5),
                            round_of(5.0, 10.0, 6.0)])  # fmt: skip
    assert summary["images_per_s"] == pytest.approx(30 / 10)
    assert summary["cpu_ms_per_image"] == pytest.approx(1000 * 15 / 30)
    assert summary["cpu_ms_per_image_median"] == pytest.approx(300.0)  # the 10 s round left out
    assert summary["system_cpu_share"] == pytest.approx(7.5 / 15)
    assert summary["round_images_per_s"] == [5.0, pytest.approx(10 / 3), 2.0]


def test_unknown_systems_and_architectures_are_refused(
    fb: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fb.parse_args(["--systems", "hf,tgi"])
    assert exit_info.value.code == 2
    assert "unknown systems ['tgi']" in capsys.readouterr().err
    from aiomm.errors import UnknownArchitectureError

    with pytest.raises(UnknownArchitectureError):
        fb.parse_args(["--models", "no-such-model"])
