"""Parsing the package's own source files in tests."""

from __future__ import annotations

import ast
from pathlib import Path


def parse_file(path: Path, attempts: int = 5) -> ast.Module:
    """``ast.parse`` of ``path``, retried on CPython 3.11's spurious ``SystemError``.

    Why: 3.11 keeps the AST constructor's recursion depth in state shared by threads
    (cpython gh-106905), so a parse racing another thread's (Triton's interpreter parses its
    kernels in pipeline threads) fails with "AST constructor recursion depth mismatch" though
    the source is fine.
    """
    source = path.read_text()
    for attempt in range(attempts):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
