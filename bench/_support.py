"""What the benchmark scripts share with the tests: the float64 reference, found in the checkout.

The scripts run as ``python bench/<script>.py``, so this folder is on ``sys.path``; the reference
lives in ``tests/support/norm_reference.py`` (one copy, as Liger-Kernel's benchmarks import their
baselines from the tests), which pytest reaches through its ``pythonpath`` and the scripts
through :func:`load_reference`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

__all__ = ("REPO", "SUPPORT", "load_reference")

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"


def load_reference() -> ModuleType:
    """``tests/support/norm_reference.py``: the float64 reference the tests use (one copy).

    :raises ImportError: the checkout has no ``tests/support/norm_reference.py``.
    """
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    try:
        return importlib.import_module("norm_reference")
    except ModuleNotFoundError as exc:
        if exc.name != "norm_reference":
            raise
        raise ImportError(
            f"no float64 reference at {SUPPORT / 'norm_reference.py'}: run the benchmarks from a "
            "checkout of aiomm"
        ) from exc
