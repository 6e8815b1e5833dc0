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
