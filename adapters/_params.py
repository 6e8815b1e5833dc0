"""Reading per-request processor kwargs against an image processor's defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ("as_floats", "size_edges")


def as_floats(values: Any) -> tuple[float, ...]:
    """Mean/std as a tuple of floats; a scalar applies to all three channels (as HF allows)."""
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    return tuple(float(v) for v in values)


def size_edges(size: Any) -> tuple[int | None, int | None]:
    """``(shortest_edge, longest_edge)`` of a size dict or an HF ``SizeDict``."""
    get = size.get if isinstance(size, Mapping) else lambda k, d=None: getattr(size, k, d)
    return get("shortest_edge", None), get("longest_edge", None)
