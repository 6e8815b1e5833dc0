"""What a failed task group stands for: one typed error, not the group.

A request's items are loaded concurrently in a task group; when one fails, anyio raises an
exception group that a caller catching ``AiommError`` (or a server mapping errors to status
codes) would not recognise. :func:`first_error` picks the error the request failed with.
"""

from __future__ import annotations

import sys

from .errors import AiommError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ("first_error",)


def first_error(
    group: BaseExceptionGroup,
    prefer: type[BaseException] | tuple[type[BaseException], ...] = AiommError,
) -> BaseException:
    """The first of ``group``'s (nested) leaves that is a ``prefer``, else its first leaf;
    never a group."""
    leaves = _leaves(group)
    return next((e for e in leaves if isinstance(e, prefer)), leaves[0])


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
