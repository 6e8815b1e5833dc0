"""The package installs as aiomm, aiomm.kernels, aiomm.adapters; never a top-level ``kernels``."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

import aiomm
from aiomm.logging import configure_logging

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["aiomm", "aiomm.kernels", "aiomm.adapters", "aiomm.processing"])
def test_subpackages_import(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__name__ == name


def _points_into_repo(spec: importlib.machinery.ModuleSpec | None) -> bool:
    if spec is None:
        return False
    locations = [spec.origin, *(spec.submodule_search_locations or [])]
    return any(loc and Path(loc).resolve().is_relative_to(REPO) for loc in locations)


def test_no_top_level_kernels_or_adapters_in_this_process() -> None:
    for name in ("kernels", "adapters"):
        assert not _points_into_repo(importlib.util.find_spec(name)), name


def test_no_top_level_kernels_from_another_directory(tmp_path: Path) -> None:
    code = (
        "import importlib.util, json; "
        "s = importlib.util.find_spec('kernels'); "
        "locs = None if s is None else [s.origin, *(s.submodule_search_locations or [])]; "
        "print(json.dumps(locs))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    found = json.loads(out.stdout)
    if found is not None:
        assert not any(loc and Path(loc).resolve().is_relative_to(REPO) for loc in found)


def test_kernels_dir_refuses_top_level_import(tmp_path: Path) -> None:
    # Even with the repository root on sys.path, `import kernels` must not silently succeed.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", "import kernels"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "aiomm.kernels" in out.stderr


def test_public_api_is_sorted_tuple() -> None:
    assert isinstance(aiomm.__all__, tuple)
    assert list(aiomm.__all__) == sorted(aiomm.__all__)
    for name in aiomm.__all__:
        assert hasattr(aiomm, name), name


def test_import_aiomm_loads_no_heavy_modules() -> None:
    heavy = "('torch', 'triton', 'transformers')"
    code = f"import sys, aiomm; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_configure_logging_emits_json_lines_when_not_a_tty() -> None:
    buf = io.StringIO()  # StringIO.isatty() is False
    configure_logging(stream=buf, level="DEBUG")
    log = structlog.get_logger("aiomm.test")
    log.info("first_event", request_id="r1", images=2)
    log.debug("second_event", stage="decode")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["event"] == "first_event" and first["request_id"] == "r1" and first["images"] == 2
    assert first["level"] == "info" and "timestamp" in first
    assert second["event"] == "second_event" and second["level"] == "debug"


def test_configure_logging_level_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOMM_LOG_LEVEL", "warning")
    buf = io.StringIO()
    configure_logging(stream=buf)
    log = structlog.get_logger("aiomm.test")
    log.info("hidden")
    log.warning("shown")
    events = [json.loads(line)["event"] for line in buf.getvalue().splitlines()]
    assert events == ["shown"]


def test_configure_logging_console_renderer_on_tty() -> None:
    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    buf = FakeTTY()
    configure_logging(stream=buf, level="INFO")
    structlog.get_logger("aiomm.test").info("pretty_event", k=1)
    text = buf.getvalue()
    assert "pretty_event" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_configure_logging_rejects_unknown_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOMM_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match=r"(?i)chatty"):
        configure_logging(stream=io.StringIO())
