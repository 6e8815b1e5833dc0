"""Reading per-request processor kwargs against an image processor's defaults.

An adapter declares its transform parameters as a frozen dataclass; :func:`resolve_params` fills
each field from the request's kwargs, else from the image processor's attribute of the same name,
converted by the field's type (or by ``field(metadata={"convert": fn})``). Parameters that need
parsing (``size`` into pixel bounds, say) are computed by the adapter and passed in.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from aiomm.processing.image_ops import Resample

__all__ = ("as_floats", "resolve_params", "size_edges")

T = TypeVar("T")


def as_floats(values: Any) -> tuple[float, ...]:
    """Mean/std as a tuple of floats; a scalar applies to all three channels (as HF allows)."""
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    return tuple(float(v) for v in values)


def as_resample(value: Any) -> Resample:
    """A PIL resampling filter code (or ``Resample``) as :class:`Resample`."""
    return Resample(int(value))


def size_edges(size: Any) -> tuple[int | None, int | None]:
    """``(shortest_edge, longest_edge)`` of a size dict or an HF ``SizeDict``."""
    get = size.get if isinstance(size, Mapping) else lambda k, d=None: getattr(size, k, d)
    return get("shortest_edge", None), get("longest_edge", None)


#: a field's converter, by its annotated type
_CONVERTERS: dict[Any, Callable[[Any], Any]] = {
    int: int,
    float: float,
    bool: bool,
    Resample: as_resample,
    tuple[float, ...]: as_floats,
}


@functools.cache
def _readers(cls: type) -> tuple[tuple[str, Callable[[Any], Any] | None, Any], ...]:
    """``(name, convert, default)`` of every field of the params dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, f.metadata.get("convert") or _CONVERTERS.get(hints[f.name]), f.default)
        for f in dataclasses.fields(cls)
    )


def resolve_params(
    cls: type[T], image_processor: Any, hf_kwargs: Mapping[str, Any], **given: Any
) -> T:
    """The params dataclass ``cls`` for one request.

    Each field not in ``given`` is ``convert(hf_kwargs.get(name, getattr(image_processor,
    name)))``; a field with a default takes it when the image processor lacks the attribute.

    :raises AttributeError: if neither the kwargs nor the image processor have a field without
        a default.
    :raises TypeError: for a field not in ``given`` whose type has no converter.
    """
    values = dict(given)
    # as a plain type: mypy does not see a type[T] of an unbounded T as Hashable (the cache key)
    for name, convert, default in _readers(cast(type, cls)):
        if name in values:
            continue
        if convert is None:
            raise TypeError(
                f"{cls.__qualname__}.{name}: pass it to resolve_params or give the field "
                "metadata={'convert': fn}; its type has no converter"
            )
        if name in hf_kwargs:
            value = hf_kwargs[name]
        elif default is dataclasses.MISSING:
            value = getattr(image_processor, name)
        else:
            value = getattr(image_processor, name, default)
        values[name] = convert(value)
    return cls(**values)
