"""``bench/gpu_suite.py`` and ``bench/kernel_bench.py`` run as README runs them, CPU parts.

Each runs in a fresh interpreter (``python bench/<script>.py ...``, ``TRITON_INTERPRET=1``), so
nothing pytest puts on ``sys.path`` can hide a broken import: the benchmarks reach the tests'
float64 reference (``tests/support/norm_reference.py``) on their own. No timing is asserted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fresh_python import run_script

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
REFERENCE = REPO / "tests" / "support" / "norm_reference.py"
# the README's environment: the interpreter kernel on the CPU; no PYTHONPATH help
ENV = {"TRITON_INTERPRET": "1"}
UNSET = ("PYTHONPATH",)
PASSED = ("ok", "skipped")
CPU_SECTIONS = [
    "native_correctness",
    "cpu_stage_correctness",
    "h2d_bandwidth",
    "uint8_vs_bf16",
    "kernel_vs_copy",
    "device_stage_throughput",
    "engine_e2e",
    "resize_kernel",
    "engine_device_resize",
]


def run(script: Path, *args: str) -> tuple[int, str, str]:
    done = run_script(script, *args, env=ENV, unset=UNSET, cwd=REPO, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_gpu_suite_quick_passes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    code, stdout, stderr = run(BENCH / "gpu_suite.py", str(out), "--quick", "--seed", "7")
    report = json.loads((out / "results.json").read_text())
    status = {s["name"]: s["status"] for s in report["sections"]}
    errors = {s["name"]: s.get("error") for s in report["sections"] if s["status"] not in PASSED}
    assert code == 0 and not errors, f"exit {code}: {errors}\n{stderr[-3000:]}"
    if not report["cuda"]:
        assert list(status) == CPU_SECTIONS
        assert {n for n, s in status.items() if s == "ok"} == {
            "native_correctness",
            "cpu_stage_correctness",
            "engine_e2e",
            "resize_kernel",
            "engine_device_resize",
        }
    for section in report["sections"]:
        if section["status"] == "ok":
            bad = [row for row in section["rows"] if row.get("ok") is False]
            assert section["rows"] and not bad, (section["name"], bad)
    assert (out / "results.md").read_text().startswith("# aiomm device-stage suite")
    # the summary table is the last thing printed: one line per section
    tail = stdout.rstrip().splitlines()[-len(status) :]
    assert [line.split("|")[1].strip() for line in tail] == list(status), stdout[-2000:]
    assert "no section failed" in stdout


def test_kernel_bench_quick_checks_against_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "kernel_bench.json"
    code, stdout, stderr = run(BENCH / "kernel_bench.py", "--quick", "--json", str(path))
    assert code == 0, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    rows = json.loads(path.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["NCHW", "PATCHES"]
    assert all(row["check"] == "ok" for row in rows), rows


def copy_benches(root: Path, reference: str | None) -> Path:
    """``bench/`` in a tree of its own, with ``reference`` as ``tests/support/norm_reference.py``
    (None: no reference at all)."""
    (root / "bench").mkdir(parents=True)
    for name in ("gpu_suite.py", "kernel_bench.py", "_support.py"):
        shutil.copy(BENCH / name, root / "bench" / name)
    if reference is not None:
        (root / "tests" / "support").mkdir(parents=True)
        (root / "tests" / "support" / "norm_reference.py").write_text(reference)
    return root / "bench"


@pytest.mark.parametrize(
    ("case", "fails"),
    [("present", False), ("missing", True), ("imports a pytest-only helper", True)],
)
def test_a_broken_reference_import_fails_the_run(case: str, fails: bool, tmp_path: Path) -> None:
    """The check above would catch issue 20 again: a reference the scripts cannot import
    (missing, or importing a module only pytest's ``pythonpath`` provides) fails both scripts,
    and the same copied scripts pass with the reference in place."""
    source = REFERENCE.read_text()
    reference = {
        "present": source,
        "missing": None,
        # what test_norm.py did: a module that only pytest's pythonpath makes importable
        "imports a pytest-only helper": source.replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nimport fresh_python  # noqa: F401\n",
            1,
        ),
    }[case]
    assert reference != source or case == "present"
    bench = copy_benches(tmp_path / "tree", reference)
    out = tmp_path / "gpu"
    code, stdout, stderr = run(bench / "gpu_suite.py", str(out), "--quick", "--only",
                               "native_correctness")  # fmt: skip
    section = json.loads((out / "results.json").read_text())["sections"][0]
    assert section["name"] == "native_correctness"
    kb_code, _, kb_stderr = run(bench / "kernel_bench.py", "--quick")
    if not fails:
        assert code == 0 and section["status"] == "ok", stderr[-3000:]
        assert kb_code == 0, kb_stderr[-3000:]
        return
    missing = "norm_reference" if reference is None else "fresh_python"
    assert code == 1 and section["status"] == "failed", stdout[-2000:]
    assert missing in section["error"] and "sections failed: native_correctness" in stderr
    assert "1 section(s) FAILED" in stdout
    assert kb_code != 0 and missing in kb_stderr, kb_stderr[-3000:]
