"""``resolve_params``: request kwargs over the image processor's defaults, converted by type."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from aiomm.adapters._params import resolve_params
from aiomm.processing.image_ops import Resample


@dataclass(frozen=True)
class _Params:
    patch_size: int
    resample: Resample
    do_resize: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    bounds: tuple[int, int]  # no converter: always given
    label: str = dataclasses.field(default="x", metadata={"convert": str.upper})
    expand: int = 1


IP = SimpleNamespace(
    patch_size=14.0, resample=3, do_resize=1, rescale_factor=1 / 255, image_mean=[0.5, 0.25, 1]
)


def test_kwargs_win_over_the_image_processor_and_values_are_converted() -> None:
    p = resolve_params(_Params, IP, {"patch_size": "16", "image_mean": 0.5}, bounds=(1, 2))
    assert p == _Params(16, Resample.BICUBIC, True, 1 / 255, (0.5, 0.5, 0.5), (1, 2), "X", 1)
    assert type(p.patch_size) is int and type(p.do_resize) is bool
    assert type(p.image_mean[0]) is float and p.resample is Resample.BICUBIC
    q = resolve_params(_Params, IP, {}, bounds=(3, 4), patch_size=7)
    assert q.patch_size == 7 and q.image_mean == (0.5, 0.25, 1.0)


def test_defaults_apply_only_where_the_image_processor_lacks_the_attribute() -> None:
    ip = SimpleNamespace(**vars(IP), label="glm", expand=2)
    p = resolve_params(_Params, ip, {"expand": "3"}, bounds=(1, 2))
    assert (p.label, p.expand) == ("GLM", 3)
    assert resolve_params(_Params, ip, {}, bounds=(1, 2)).expand == 2


def test_missing_values_and_unconvertible_fields_are_named() -> None:
    with pytest.raises(AttributeError, match="patch_size"):
        resolve_params(_Params, SimpleNamespace(), {}, bounds=(1, 2))
    with pytest.raises(TypeError, match=r"_Params\.bounds"):
        resolve_params(_Params, IP, {})
