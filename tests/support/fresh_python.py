"""Run test code in a fresh interpreter (process-wide state: environment, imports, malloc)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Collection, Mapping

__all__ = ("run_python",)


def run_python(
    code: str,
    *,
    unset: Collection[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with this interpreter; the environment is ours without ``unset``, plus
    ``env``. Output is captured as text; the exit status is not checked."""
    full = {k: v for k, v in os.environ.items() if k not in unset}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=timeout
    )
