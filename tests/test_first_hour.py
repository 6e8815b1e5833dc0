"""A new user's first tries, through the installed ``aiomm`` command, from a working folder of
their own: relative paths, where the results go, what an error names, unknown models, the
version and the help."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aiomm.cli import _parser
from aiomm.media.samples import encode, photo_like

AIOMM = shutil.which("aiomm") or str(Path(sys.executable).with_name("aiomm"))


def aiomm(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [AIOMM, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def _jpeg(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(photo_like(np.random.default_rng(seed), 60, 80), "JPEG"))
    return path


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working folder holding imgs/a.jpg."""
    folder = tmp_path / "work"
    _jpeg(folder / "imgs" / "a.jpg")
    return folder


def test_a_relative_file_and_a_file_outside_named_on_the_command_line(
    work: Path, tmp_path: Path
) -> None:
    elsewhere = _jpeg(tmp_path / "elsewhere" / "c.jpg", seed=1)  # named: the user allowed it
    _jpeg(tmp_path / "elsewhere" / "d.jpg", seed=2)  # not named
    done = aiomm("run", "imgs/a.jpg", "./imgs/a.jpg", str(elsewhere), "--no-progress", cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    rows = _rows(work / "aiomm-results.jsonl")  # the default output, in the working folder
    assert [r["sources"] for r in rows] == [["imgs/a.jpg"], ["./imgs/a.jpg"], [str(elsewhere)]]
    assert all(r["ok"] for r in rows)
    assert "aiomm-results.jsonl" in done.stdout
    assert "qwen2-vl" in done.stdout and "device" in done.stdout  # the summary names them


def test_a_relative_folder_with_a_corrupt_file(work: Path) -> None:
    (work / "imgs" / "bad.jpg").write_bytes(b"not an image")
    done = aiomm("run", "imgs/", "--no-progress", "--output", "out.jsonl", cwd=work)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    rows = {tuple(r["sources"]): r for r in _rows(work / "out.jsonl")}  # type: ignore[arg-type]
    assert rows[("imgs/a.jpg",)]["ok"]
    bad = rows[("imgs/bad.jpg",)]
    assert not bad["ok"]
    assert "DecodeError" in str(bad["error"]) and "imgs/bad.jpg" in str(bad["error"])
    (line,) = [line for line in done.stdout.splitlines() if "error" in line]
    assert "DecodeError" in line and "imgs/bad.jpg" in line
    assert not (work / "aiomm-results.jsonl").exists()


def test_the_allowed_root_overrides_the_default(work: Path, tmp_path: Path) -> None:
    elsewhere = _jpeg(tmp_path / "elsewhere" / "c.jpg")
    args = ("run", "imgs/a.jpg", str(elsewhere), "--allowed-root", "imgs", "--no-progress")
    done = aiomm(*args, cwd=work)
    assert done.returncode == 1, done.stdout + done.stderr
    first, second = _rows(work / "aiomm-results.jsonl")
    assert first["ok"]
    assert "PathNotAllowedError" in str(second["error"]) and str(elsewhere) in str(second["error"])
    assert "--allowed-root" in str(second["error"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("run", "x.jpg", "--model", "qwen-vl-7b"), "qwen2-vl"),
        (("serve", "qwen-vl-7b"), "qwen2-vl"),
        (("run", "x.jpg", "--model", "Qwen/Qwen2-VL-2B-Instruct"), "huggingface-cli download"),
        (("serve", "Qwen/Qwen2-VL-2B-Instruct"), "--local-dir ./Qwen2-VL-2B-Instruct"),
    ],
)
def test_an_unknown_model_is_one_line(args: tuple[str, ...], expected: str, tmp_path: Path) -> None:
    done = aiomm(*args, cwd=tmp_path)
    assert done.returncode != 0
    printed = (done.stdout + done.stderr).strip()
    assert "Traceback" not in printed
    assert len(printed.splitlines()) == 1, printed
    assert expected in printed


def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    done = aiomm("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"aiomm {version('aiomm')}"


def test_the_cli_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, aiomm.cli; "
        "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'aiomm.engine', 'httpx') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("serve", "--help")])
def test_help_is_fast(args: tuple[str, ...], tmp_path: Path) -> None:
    aiomm(*args, cwd=tmp_path)  # warm the file cache
    t0 = time.perf_counter()
    done = aiomm(*args, cwd=tmp_path)
    elapsed = time.perf_counter() - t0
    assert done.returncode == 0
    assert elapsed < 1.0, elapsed
    assert "(default: None)" not in done.stdout
    if args[0] == "run":
        assert "aiomm-results.jsonl" in done.stdout


def test_bench_help_shows_no_none_default(tmp_path: Path) -> None:
    done = aiomm("bench", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(default: None)" not in done.stdout and "--quick" in done.stdout


def test_standin_help(tmp_path: Path) -> None:
    done = aiomm("standin", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--port" in done.stdout and "8001" in done.stdout and "without a GPU" in done.stdout


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help() -> None:
    parser = _parser()
    commands = _subcommands(parser)
    assert {"run", "serve", "standin", "bench"} <= set(commands)
    for name, sub in [("aiomm", parser), *commands.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), (name, action.dest)
    serve_flags = {s for a in commands["serve"]._actions for s in a.option_strings}
    run_flags = {s for a in commands["run"]._actions for s in a.option_strings}
    for flag in ("--allowed-media-domains", "--allow-private-networks"):
        assert flag in serve_flags and flag in run_flags
    assert "--allowed-local-media-path" in serve_flags


async def test_the_server_passes_its_fetch_flags_and_names_its_own_flag(tmp_path: Path) -> None:
    from qwen2vl_folder import build_folder

    from aiomm.errors import PathNotAllowedError
    from aiomm.media.fetch import MediaFetcher
    from aiomm.server.config import ServerConfig
    from aiomm.server.state import open_state

    folder = build_folder(tmp_path / "model")
    config = ServerConfig(
        model=str(folder), allowed_media_domains=("LocalHost",), allow_private_networks=True
    )
    async with open_state(config) as state:
        assert state.engine is not None
        fetch = state.engine.config.fetch
    assert fetch.allowed_media_domains == ("localhost",)
    assert fetch.allow_loopback and fetch.allow_private_addresses
    async with MediaFetcher(fetch) as fetcher:
        with pytest.raises(PathNotAllowedError, match="--allowed-local-media-path") as info:
            await fetcher.fetch((tmp_path / "x.png").as_uri())
    assert "FetchConfig" not in str(info.value)
