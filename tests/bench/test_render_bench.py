"""``bench/render_bench.py --plans``: its bodies, its ratios and its arguments (no servers).

No timing is asserted: speed is what the benchmark prints, side by side, in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def rb() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        yield importlib.import_module("render_bench")


def _args(payload: str) -> argparse.Namespace:
    return argparse.Namespace(
        n=6, sizes="32x24,48x32", two_image_frac=0.5, repeat_frac=0.0, mm_payload=payload,
        model_folder="/m",
    )  # fmt: skip


def _row(rb: ModuleType, server: str, images_per_s: float, cpu_s: float) -> object:
    """A combined row of 100 images over 2 s at concurrency 8."""
    ms = round(cpu_s * 1000 / 100, 1)
    return rb.LevelResult(server, 8, 50, 100, 2.0, images_per_s, 10.0, 20.0, ms, 0.5, 1.0, 0.2,
                          0.1, cpu_s)  # fmt: skip


def test_bodies_with_another_payload_are_that_payload_s_bodies(rb: ModuleType) -> None:
    tensors, images = rb.build_bodies(_args("tensors"), seed=7)
    none, same_images = rb.build_bodies(_args("none"), seed=7)
    assert images == same_images and tensors != none
    assert rb.with_payload(tensors, "none") == none  # the same images, byte for byte
    assert rb.with_payload(none, "tensors") == tensors
    assert {json.loads(b)["mm_payload"] for b in rb.with_payload(tensors, "none")} == {"none"}


def test_each_system_gets_its_payload_s_bodies_made_once_per_plan(rb: ModuleType) -> None:
    bodies, _ = rb.build_bodies(_args("tensors"), seed=1)
    payloads = {name: payload for name, (_, payload) in rb.PLAN_SYSTEMS.items()}
    of = rb._Payloads(bodies, "tensors", payloads)
    assert of("aiomm-tensors") is bodies
    none = of("aiomm-none")
    assert none == rb.with_payload(bodies, "none")
    assert of("vllm-none") is none  # one copy of the plan per payload, not per system
    assert of("unnamed") is bodies  # a system without a payload: the plan's own
    assert rb._Payloads(bodies, "tensors")("aiomm") is bodies  # the default modes: unchanged


def test_plan_ratios_divide_the_measured_cpu_not_the_rounded_column(rb: ModuleType) -> None:
    rows = [
        _row(rb, "aiomm-tensors", 50.0, 2.0),  # 20 ms per image
        _row(rb, "aiomm-none", 400.0, 0.033),  # 0.33 ms per image; the column says 0.3
        _row(rb, "vllm-none", 100.0, 0.5),  # 5 ms per image
    ]
    assert rows[1].server_cpu_ms_per_image == 0.3
    (ratios,) = rb.plan_ratios(rows)
    assert ratios == {
        "concurrency": 8,
        "cpu_per_image_tensors_over_none": round(20 / 0.33, 3),
        "images_per_s_aiomm_none_over_vllm_none": 4.0,
        "cpu_per_image_vllm_none_over_aiomm_none": round(5 / 0.33, 3),
    }
    assert rb.plan_ratio_lines([ratios]) == [
        "c=8: aiomm CPU per image, tensors/none x60.61",
        "c=8: images/s, aiomm-none/vllm-none x4.00",
        "c=8: CPU per image, vllm-none/aiomm-none x15.15",
    ]


def test_plan_ratios_leave_out_what_was_not_measured(rb: ModuleType) -> None:
    rows = [_row(rb, "aiomm-tensors", 50.0, 2.0), _row(rb, "aiomm-none", 400.0, 0.0)]
    rows.append(dataclasses.replace(rows[0], concurrency=32))  # no aiomm-none at c=32
    assert rb.plan_ratios(rows) == [
        {"concurrency": 8, "cpu_per_image_tensors_over_none": None},  # under a clock tick
        {"concurrency": 32},
    ]
    assert rb.plan_ratio_lines(rb.plan_ratios(rows)) == [
        "c=8: aiomm CPU per image, tensors/none n/a (no CPU measured)"
    ]


def test_combined_rows_keep_the_cpu_seconds_of_their_rounds(rb: ModuleType) -> None:
    a, b = _row(rb, "aiomm-none", 400.0, 0.033), _row(rb, "aiomm-none", 400.0, 0.041)
    (row,) = rb._combine([a, b])
    assert row.server_cpu_s == pytest.approx(0.074)
    assert row.cpu_ms_per_image == pytest.approx(0.37)
    assert row.server_cpu_ms_per_image == 0.4  # the table's column: rounded, as before
    # rows without CPU seconds (made before they were kept) fall back to the rounded column
    old = dataclasses.replace(a, server_cpu_s=0.0)
    assert old.cpu_ms_per_image == 0.3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compare-flags=--no-peer-cache"], "no --compare-flags or --compare-build"),
        (["--cache-gb", "1"], "with its cache off, not --cache-gb 1.0"),
    ],
)
def test_plans_refuse_a_second_aiomm_server_or_a_cache(
    rb: ModuleType, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        rb.main(["--plans", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
