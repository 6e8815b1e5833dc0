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
    )
    for label in labels:
        assert label in printed
