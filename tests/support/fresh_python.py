"""Run test code or a script in a fresh interpreter (process-wide state: environment, imports,
malloc, ``sys.path``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Collection, Mapping
from pathlib import Path

__all__ = ("run_python", "run_script")


def run_python(
    code: str,
    *,
    unset: Collection[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with this interpreter; the environment is ours without ``unset``, plus
    ``env``. Output is captured as text; the exit status is not checked."""
    return _run([sys.executable, "-c", code], unset=unset, env=env, timeout=timeout, cwd=None)


def run_script(
    script: Path,
    *args: str,
    unset: Collection[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS...`` with this interpreter, as a user runs it from a shell (the
    script's folder, not ours, starts its ``sys.path``); environment and output as for
    :func:`run_python`."""
    command = [sys.executable, str(script), *args]
    return _run(command, unset=unset, env=env, timeout=timeout, cwd=cwd)


def _run(
    command: list[str],
    *,
    unset: Collection[str],
    env: Mapping[str, str] | None,
    timeout: float,
    cwd: Path | None,
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in unset}
    full.update(env or {})
    return subprocess.run(
        command, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
