"""Logging for aiomm: structlog events on standard-library loggers, silent until asked.

Every aiomm module logs through ``get_logger(__name__)``: a structlog ``BoundLogger`` over the
standard-library logger of that name (``aiomm.engine._engine``, ``aiomm.media.fetch``, ...).
The host application's :mod:`logging` configuration therefore decides what is shown and where:

- Unconfigured, aiomm prints nothing: a ``NullHandler`` on the ``aiomm`` logger keeps even
  warnings away from :data:`logging.lastResort`, as the logging HOWTO asks of libraries.
- Levels are the standard library's: an event below the logger's effective level is dropped
  before any processor runs.
- Credentials are masked before any processor sees an event (:func:`aiomm.redaction.redact` on
  every string field and on the formatted traceback of ``log.exception``): URLs in events and
  errors may carry user info or signed queries.
- aiomm never calls :func:`structlog.configure`. If the application configured structlog, its
  processors shape aiomm's events too (context variables, timestamps, renderer), and their result
  goes to the stdlib logger. Otherwise the record's ``msg`` is the event dict itself, which a plain
  formatter shows as ``event key=value ...`` and :class:`structlog.stdlib.ProcessorFormatter`
  renders with every field.

:func:`configure_logging` is for programs that do not configure logging themselves (``aiomm run``,
scripts): it sends aiomm's events to stderr as JSON lines, or a console format on a TTY.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from aiomm.errors import ConfigError
from aiomm.redaction import redact

__all__ = ("configure_logging", "get_logger")

_ROOT = "aiomm"
_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}

logging.getLogger(_ROOT).addHandler(logging.NullHandler())


class _Event(dict[str, Any]):
    """An event dict as a stdlib record's ``msg``: plain formatters call ``str()`` on it."""

    def __str__(self) -> str:
        fields = " ".join(f"{k}={v!r}" for k, v in self.items() if k != "event")
        event = str(self.get("event", ""))
        return f"{event} {fields}" if fields else event


def _to_stdlib(
    logger: WrappedLogger, method_name: str, event_dict: EventDict
) -> tuple[tuple[_Event], dict[str, Any]]:
    # The same shape as ProcessorFormatter.wrap_for_formatter, so that formatter renders it.
    return (_Event(event_dict),), {"extra": {"_logger": logger, "_name": method_name}}


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, BaseException):
        return redact(f"{type(value).__name__}: {value}")
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(v) for v in value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    return value


def _redact_event(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    if event_dict.get("exc_info"):
        # formatted here, so a chained library exception's message is masked too
        event_dict = structlog.processors.format_exc_info(logger, method_name, event_dict)
    return {key: _masked(value) for key, value in event_dict.items()}


_OWN_PROCESSORS: Sequence[Processor] = (structlog.contextvars.merge_contextvars, _to_stdlib)


def _shape(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> Any:
    # Read at every event, not bound once: the application may configure structlog after
    # importing aiomm (and structlog.testing.capture_logs swaps the processors for a while).
    processors = structlog.get_config()["processors"] if structlog.is_configured() else None
    result: Any = event_dict
    for processor in processors if processors is not None else _OWN_PROCESSORS:
        result = processor(logger, method_name, result)
    return result


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """Return aiomm's structlog logger for module ``name``, backed by ``logging.getLogger(name)``.

    Configuring nothing global, it leaves the application's structlog configuration alone.
    """
    return structlog.stdlib.BoundLogger(
        logging.getLogger(name), [structlog.stdlib.filter_by_level, _redact_event, _shape], {}
    )


def _resolve_level(level: str | int | None) -> int:
    if isinstance(level, int):
        return level
    name = (level or os.environ.get("AIOMM_LOG_LEVEL") or "INFO").strip().upper()
    if name not in _LEVELS:
        raise ConfigError(
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


# the handler configure_logging() installed last; a second call replaces it
_handler: logging.Handler | None = None


def configure_logging(
    *, level: str | int | None = None, stream: TextIO | None = None, json: bool | None = None
) -> None:
    """Show aiomm's events: a handler on the ``aiomm`` logger rendering JSON lines or a console.

    Meant for programs that do not configure logging themselves; an application that does
    should leave this alone and attach its own handlers (or none). Calling it again replaces the
    handler it installed. Other loggers and structlog's global configuration are not touched.

    :param level: a level name or number; defaults to ``AIOMM_LOG_LEVEL`` (else ``INFO``).
    :param stream: where events go; defaults to ``sys.stderr`` (whatever it is when writing).
    :param json: force JSON lines (True) or the console renderer (False); by default JSON unless
        ``stream`` is a TTY.
    :raises ConfigError: if the level name is unknown.
    """
    global _handler
    resolved = _resolve_level(level)
    out: TextIO = stream if stream is not None else _CurrentStderr()  # type: ignore[assignment]
    if json is None:
        json = not (hasattr(out, "isatty") and out.isatty())
    renderer: Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
        )
    )
    root = logging.getLogger(_ROOT)
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(resolved)
    _handler = handler
