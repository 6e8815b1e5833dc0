"""Which torch functions a piece of code calls (``sys.setprofile``): every torch call releases
the GIL, even one that only makes a view, so worker-thread paths are checked for them.

The profile sees calls of C functions and methods (``t.reshape(...)``, ``torch.tensor(...)``),
not torch reached through syntax (indexing, arithmetic operators, ``.T``) nor deallocation."""

from __future__ import annotations

import collections
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ("NO_GIL_RELEASE", "torch_calls")

#: torch calls that keep the GIL: conversions to and from numpy and attribute reads
NO_GIL_RELEASE = frozenset(
    {
        "from_numpy",
        "_from_dlpack",  # torch.from_dlpack's C half (read-only arrays)
        "numpy",
        "tolist",
        "dim",
        "numel",
        "element_size",
        "_has_torch_function_unary",  # Tensor.__len__'s own bookkeeping
        "_get_tracing_state",
    }
)


def _is_torch(fn: Any) -> bool:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    if isinstance(owner, types.ModuleType):
        return owner.__name__.startswith("torch")
    module = getattr(fn, "__module__", None) or type(owner).__module__
    return module.startswith("torch")


def torch_calls(fn: Callable[[], Any]) -> tuple[Any, collections.Counter[str]]:
    """``fn()``'s result and how often it called each torch function (by name), in this thread."""
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and _is_torch(arg):
            calls[arg.__name__] += 1

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls
