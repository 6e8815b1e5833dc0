"""Optional OpenTelemetry spans: one per request and per engine stage, W3C ``traceparent`` read
from incoming requests and sent to the upstream engine.

Off, and free, unless OpenTelemetry is installed (``aiomm[otel]``) and the host configured a
tracer provider (``opentelemetry.trace.set_tracer_provider``, or the SDK's auto-configuration):
aiomm configures none itself, as a library leaves its host's telemetry alone. Whether tracing is
on is read when an engine or a server starts (:func:`tracing_enabled`); while it is off, every
:func:`span` is a shared do-nothing context manager.

Spans: ``aiomm.request`` (the engine's request: ``aiomm.images``, ``aiomm.videos``,
``aiomm.plan``), under it ``aiomm.admission``, per item ``aiomm.fetch``, ``aiomm.hash``,
``aiomm.cache`` (``aiomm.cache.outcome``), ``aiomm.transform`` (or ``aiomm.plan``), then
``aiomm.assemble`` and ``aiomm.device``; in ``aiomm serve``, ``aiomm.render`` (the HTTP request,
``aiomm.endpoint``, ``http.response.status_code``) above them, ``aiomm.encode`` (the tensors'
wire form) and, in gateway mode, ``aiomm.upstream`` (the call to the engine, whose
``traceparent`` it carries). A failed span records its error type (``error.type``) and status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

__all__ = (
    "attached",
    "extract_context",
    "inject_context",
    "past_span",
    "set_attribute",
    "span",
    "tracing_enabled",
)

_NOOP = contextlib.nullcontext()
#: the OpenTelemetry tracer while tracing is on (:func:`tracing_enabled`), else None
_tracer: Any = None


def tracing_enabled() -> bool:
    """Whether spans are recorded: OpenTelemetry is installed and a tracer provider other than
    its default no-op one is set. Read again at each call (an engine's or a server's start)."""
    global _tracer
    try:
        from opentelemetry import trace
    except ImportError:
        _tracer = None
        return False
    provider = trace.get_tracer_provider()
    configured = not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    _tracer = trace.get_tracer("aiomm") if configured else None
    return configured


def span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A context manager recording the span ``name`` (a child of the current one) while tracing
    is on; a shared no-op otherwise. The span is the context manager's value (None when off)."""
    if _tracer is None:
        return _NOOP
    return _recorded(name, attributes)


@contextlib.contextmanager
def _recorded(name: str, attributes: Mapping[str, Any] | None) -> Iterator[Any]:
    from opentelemetry.trace import Status, StatusCode

    with _tracer.start_as_current_span(
        name,
        attributes=dict(attributes or {}),
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except BaseException as exc:
            current.set_attribute("error.type", type(exc).__name__)
            current.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def past_span(name: str, start_ns: int, end_ns: int) -> None:
    """Record the span ``name`` that ran from ``start_ns`` to ``end_ns`` (``time.time_ns``), a
    child of the current one (a wait measured before its span could be opened)."""
    if _tracer is not None:
        _tracer.start_span(name, start_time=start_ns).end(end_time=end_ns)


def set_attribute(current: Any, key: str, value: Any) -> None:
    """Set ``key`` on the span :func:`span` yielded (nothing when tracing is off)."""
    if current is not None:
        current.set_attribute(key, value)


def extract_context(headers: Mapping[str, str]) -> Any:
    """The trace context of an incoming request's ``traceparent`` (W3C), or None (tracing off,
    or no such header)."""
    if _tracer is None or "traceparent" not in headers:
        return None
    from opentelemetry.propagate import extract

    return extract(dict(headers))


@contextlib.contextmanager
def attached(context: Any) -> Iterator[None]:
    """Make ``context`` (from :func:`extract_context`) current while the block runs."""
    if context is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def inject_context(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` to outgoing ``headers`` (nothing when off)."""
    if _tracer is None:
        return
    from opentelemetry.propagate import inject

    inject(headers)
