"""bench/reliability.py end to end at smoke size: every section runs and prints its figures, and
the figures say nothing was lost (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_reliability_bench_smoke(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "reliability.py"), "--smoke"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for section in ("hostile mix:", "overload:", "2x (", "5x (", "cancellation storm:", "soak:",
                    "restarts:", "fuzz:"):  # fmt: skip
        assert section in text, (section, text)
    good = re.search(r"good requests equal to a clean run: (\d+)/(\d+)", text)
    assert good and good.group(1) == good.group(2), text
    typed = re.search(r"hostile requests with a typed error: (\d+)/(\d+)", text)
    assert typed and typed.group(1) == typed.group(2), text
    assert "counters balanced: True" in text
    assert "no crash" in text or "atheris not installed" in text
