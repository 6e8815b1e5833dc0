"""Parsing of the kernels' string-valued enum arguments."""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def parse_member(cls: type[E], value: E | str, error: type[Exception], what: str) -> E:
    """``value`` as a member of ``cls``; strings match member values case-insensitively.

    :raises error: for an unknown name or a value of another type, naming ``what`` and the
        accepted values.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.lower())
        except ValueError:
            pass
    names = ", ".join(repr(m.value) for m in cls)
    raise error(f"unknown {what} {value!r}; expected a {cls.__name__} or one of {names}")
