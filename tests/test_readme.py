"""README's set-up commands and .ci/run stay in step: CI runs exactly what the README says."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("python3 -m venv")]


def test_readme_has_the_two_setup_commands() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    assert commands[0].endswith("&& aiomm run")
    assert commands[1].endswith("&& TRITON_INTERPRET=1 pytest")


def test_ci_runs_the_readme_install_and_test_commands() -> None:
    ci_lines = {line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()}
    install, test = _setup_commands()[1].split(" && ")[2:]
    assert install in ci_lines, install
    assert test in ci_lines, test
