"""The package: installs as aiomm, aiomm.kernels, aiomm.adapters (never a top-level ``kernels``);
its public names, exported lazily so that ``import aiomm`` stays light."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from fresh_python import run_python

import aiomm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name",
    ["aiomm", "aiomm.kernels", "aiomm.adapters", "aiomm.processing", "aiomm.integrations.ray"],
)
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


def test_public_api_is_sorted_and_complete() -> None:
    # as httpx's tests/test_exported_members.py: every public name is in __all__, and only those;
    # lazily loaded names count as public before they are loaded
    public = {
        name
        for name, value in vars(aiomm).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    public |= set(aiomm._LAZY) | {"__version__"}
    assert isinstance(aiomm.__all__, tuple)
    assert aiomm.__all__ == tuple(sorted(public))
    assert set(dir(aiomm)) >= public


def test_every_exported_name_resolves() -> None:
    code = (
        "import aiomm\n"
        "missing = [n for n in aiomm.__all__ if getattr(aiomm, n, None) is None]\n"
        "print(missing)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    from aiomm.processing.placeholders import PlaceholderRange
    from aiomm.stream import ResultStream

    assert aiomm.ResultStream is ResultStream and aiomm.PlaceholderRange is PlaceholderRange
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aiomm.nope  # noqa: B018


def test_import_aiomm_loads_no_heavy_modules() -> None:
    heavy = "('torch', 'triton', 'transformers', 'httpx', 'numpy')"
    code = f"import sys, aiomm; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
