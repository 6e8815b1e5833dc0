"""Structured logging for aiomm: one ``configure_logging()`` for every module.

Modules log through ``structlog.get_logger(__name__)``; this function decides how the events are
rendered: a human-readable console when stderr is a TTY, JSON lines otherwise (servers, CI, log
shippers). The level comes from ``AIOMM_LOG_LEVEL`` unless given explicitly.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

__all__ = ("configure_logging",)

_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}


def _resolve_level(level: str | int | None) -> int:
    if isinstance(level, int):
        return level
    name = (level or os.environ.get("AIOMM_LOG_LEVEL") or "INFO").strip().upper()
    if name not in _LEVELS:
        raise ValueError(
            f"unknown log level {name!r} (from AIOMM_LOG_LEVEL or the argument); "
            f"expected one of {sorted(_LEVELS)}"
        )
    return logging.getLevelName(name)


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of writing.

    Binding the object that was ``sys.stderr`` at configure time breaks when it is later swapped
    and closed (test runners, daemonising servers).
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(
    *, level: str | int | None = None, stream: TextIO | None = None, json: bool | None = None
) -> None:
    """Configure structlog for aiomm.

    :param level: a level name or number; defaults to ``AIOMM_LOG_LEVEL`` (else ``INFO``).
    :param stream: where events go; defaults to ``sys.stderr``.
    :param json: force JSON lines (True) or the console renderer (False); by default JSON unless
        ``stream`` is a TTY.
    :raises ValueError: if the level name is unknown.
    """
    out: TextIO = stream if stream is not None else _CurrentStderr()  # type: ignore[assignment]
    if json is None:
        json = not (hasattr(out, "isatty") and out.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_resolve_level(level)),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
