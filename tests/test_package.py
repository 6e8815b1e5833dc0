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
    from aiomm.engine._stream import ResultStream
    from aiomm.processing.placeholders import PlaceholderRange

    assert aiomm.ResultStream is ResultStream and aiomm.PlaceholderRange is PlaceholderRange
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aiomm.nope  # noqa: B018


def test_import_aiomm_loads_no_heavy_modules() -> None:
    heavy = "('torch', 'triton', 'transformers', 'httpx', 'numpy')"
    code = f"import sys, aiomm; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_package_is_installed() -> None:
    """A non-editable install ships exactly the packages listed in pyproject.toml."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {"aiomm.kernels", "aiomm.adapters"} | {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "aiomm").rglob("__init__.py")
    }
    assert listed == on_disk


def test_engine_runs_without_the_extras() -> None:
    """uvloop and aiocache belong to the serve and shared-cache extras: the engine runs with
    neither importable."""
    code = """
import sys
import importlib.abc

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("uvloop", "aiocache", "redis", "starlette", "uvicorn"):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
import anyio, numpy as np
from aiomm import Engine, Request

async def main():
    async with Engine.from_pretrained("qwen2-vl") as engine:
        prompt = "<|vision_start|><|image_pad|><|vision_end|>"
        image = np.zeros((56, 56, 3), dtype=np.uint8)
        result = await engine.process(Request(prompt=prompt, images=[image]))
        print(len(result.prompt_token_ids), sorted(result.mm_kwargs))

anyio.run(main)
print(sorted(m for m in ("uvloop", "aiocache") if m in sys.modules))
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "pixel_values" in out.stdout


def test_light_dependencies_are_extras() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "uvloop" not in core and "aiocache" not in core
    extras = project["optional-dependencies"]
    assert any(dep.startswith("uvloop") for dep in extras["serve"])
    assert any(dep.startswith("aiocache") for dep in extras["shared-cache"])
