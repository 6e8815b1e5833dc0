"""README's set-up commands and .ci/run stay in step: CI runs exactly what the README says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def test_ci_checks_types_and_builds_the_docs_strictly() -> None:
    ci_lines = {line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()}
    assert ".ci/typecheck" in ci_lines
    assert any(line.startswith("mkdocs build --strict") for line in ci_lines)


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (REPO / target).exists(), target


_USER_DOCS = [
    "README.md",
    "CHANGELOG.md",
    *(
        str(p.relative_to(REPO))
        for p in [*(REPO / "docs").glob("*.md"), *(REPO / "bench").rglob("*.md")]
    ),
]


def test_user_documents_describe_the_software_not_the_work() -> None:
    """No period of work, session or issue number in what users read."""
    words = re.compile(
        r"\bsessions?\b|\bissues? #?\d+|#\d{2,}\b"
        r"|\b(?:tenth|eleventh|twelfth|\w+teenth|twenty-\w+)\b",
        re.I,
    )
    for name in _USER_DOCS:
        text = (REPO / name).read_text()
        found = words.findall(text)
        assert not found, (name, found[:5])


def _python_examples() -> list[str]:
    """README's Python blocks that use aiomm (the gateway's OpenAI client block is run by
    tests/server/, against a stand-in upstream)."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    return [b for b in blocks if "from aiomm import" in b]


def test_readme_has_an_api_example() -> None:
    assert any("Engine.from_pretrained" in b for b in _python_examples())


@pytest.mark.parametrize("code", _python_examples(), ids=lambda c: c.split("\n")[0][:40])
def test_readme_python_examples_run_as_written(code: str, tmp_path: Path) -> None:
    """Each example runs unchanged in a fresh process, from a working folder holding
    ``photo.jpg``, offline."""
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(
        tmp_path / "photo.jpg", quality=90
    )
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "AIOMM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the API example's stream prints one line per JPEG: its request id and token count
    lines = done.stdout.splitlines()
    if "engine.stream(" in code:
        assert len(lines) == 1 and lines[0].split()[1].isdigit(), done.stdout


def test_ci_checks_the_user_install() -> None:
    """.ci/run ends with the light install's check: `aiomm[serve]` alone, `aiomm run`,
    `aiomm serve`."""
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert ".ci/light-install" in ci_lines
    script = (REPO / ".ci" / "light-install").read_text()
    assert "[serve]" in script and 'aiomm" run' in script and 'aiomm" serve qwen2-vl' in script
