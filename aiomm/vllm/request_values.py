"""Scalar request fields read as vLLM's request models read them (pydantic's lax mode).

vLLM validates a body with pydantic before rendering it: an integer field takes an int, a bool,
a float without a fractional part or a string of an integer (``"7"``, ``"7.0"``, ``5.0`` and
``true`` are 7, 7, 5 and 1), a float field a number, a bool or a numeric string, a bool field
``true``/``false``, 0/1 or the words pydantic knows (``"no"`` is False, ``" no"`` is not a
word). Anything else is a 400 naming the field. JSON numbers beyond 64 bits (which orjson parses
as floats) are refused by the range check, so no value the response writer cannot write gets
through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from aiomm.vllm.errors import ApiError

__all__ = ("INT64_MAX", "INT64_MIN", "flag", "lax_bool", "lax_float", "lax_int")

_T = TypeVar("_T")
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_int(value: Any, param: str, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """``value`` as an integer field in ``[lo, hi]``.

    :raises ApiError: 400 naming ``param``: not an integer, or out of range.
    """
    number: int | None = None
    if isinstance(value, bool | int):
        number = int(value)
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        number = _parsed(value, int)
        if number is None:  # "7.0" is 7, as pydantic reads it
            whole = _parsed(value, float)
            number = int(whole) if whole is not None and whole.is_integer() else None
    if number is None:
        raise ApiError(f"'{param}' must be an integer, got {_shown(value)}", param=param)
    if not lo <= number <= hi:
        raise ApiError(f"'{param}' must be in [{lo}, {hi}], got {number}", param=param)
    return number


def lax_float(value: Any, param: str) -> float:
    """``value`` as a finite float field.

    :raises ApiError: 400 naming ``param``.
    """
    number: float | None = None
    if isinstance(value, int | float):  # a bool too: true is 1.0
        number = float(value)
    elif isinstance(value, str):
        number = _parsed(value, float)
    if number is None or not math.isfinite(number):
        raise ApiError(f"'{param}' must be a finite number, got {_shown(value)}", param=param)
    return number


def lax_bool(value: Any, param: str) -> bool:
    """``value`` as a bool field.

    :raises ApiError: 400 naming ``param``.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise ApiError(f"'{param}' must be a boolean, got {_shown(value)}", param=param)


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """``body[key]`` as a bool field, ``default`` when absent or null.

    :raises ApiError: 400 naming ``key``.
    """
    value = body.get(key)
    return default if value is None else lax_bool(value, key)


def _parsed(text: str, kind: Callable[[str], _T]) -> _T | None:
    try:
        return kind(text.strip())
    except ValueError:
        return None


def _shown(value: Any) -> str:
    """``value`` as a message shows it: its type for containers, its start for strings."""
    if isinstance(value, dict | list):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
