"""``FusedMMInputNorm.forward_table``: the CPU table path equals ``forward_native`` bit for bit."""

from __future__ import annotations

import os
import time

import pytest
import torch

from aiomm.errors import LayoutError, OutputBufferError, UnsupportedDtypeError
from aiomm.kernels import FusedMMInputNorm
from aiomm.kernels.table_norm import _CHUNK_ROWS, normalize_rows_by_table

NORMS = {
    "clip": (1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "half": (1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "one-channel": (1 / 255, (0.45,), (0.27,)),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture
def gen() -> tuple[torch.Generator, int]:
    seed = int(os.environ.get("AIOMM_TEST_SEED", time.time_ns() % 2**63))
    return torch.Generator().manual_seed(seed), seed


def pixels(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def cases(c: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    hwc = pixels((9, 13, c), g)
    return [
        ("nchw", pixels((c, 7, 11), g)),
        ("nchw", pixels((2, c, 5, 6), g)),
        ("nchw", hwc.permute(2, 0, 1)),  # a channels-last view, as the resize hands over
        ("nhwc", pixels((4, 5, c), g)),
        ("nhwc", pixels((2, 3, 4, c), g)),
        ("patches", pixels((6, c * 2 * 4 * 4), g)),
        ("patches", pixels((c * 8, 6), g).t()),  # strided rows
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(NORMS))
def test_equals_forward_native_bit_for_bit(name: str, dtype: torch.dtype, gen) -> None:
    norm = FusedMMInputNorm(*NORMS[name])
    g, seed = gen
    big = ("nchw", pixels((norm.num_channels, 64, 64), g))
    for layout, x in [*cases(norm.num_channels), big]:
        got = norm.forward_table(x, dtype, layout=layout)
        want = norm.forward_native(x, dtype, layout=layout)
        assert got.is_contiguous()
        assert same_bits(got, want), f"seed={seed} {name} {layout} {list(x.shape)} {dtype}"


def test_every_uint8_value_of_every_channel() -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    x = torch.arange(256, dtype=torch.uint8).repeat(3, 4, 1)  # [3, 4, 256]
    for dtype in DTYPES:
        assert same_bits(norm.forward_table(x, dtype), norm.forward_native(x, dtype))


def test_out_rows_written_and_padding_untouched() -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    x = pixels((5, 3 * 8), torch.Generator().manual_seed(1))
    out = torch.full((9, 24), float("nan"), dtype=torch.bfloat16)
    got = norm.forward_table(x, torch.bfloat16, out=out, layout="patches")
    assert got.data_ptr() == out.data_ptr() and got.shape == x.shape
    assert same_bits(out[:5], norm.forward_native(x, torch.bfloat16, layout="patches"))
    assert out[5:].isnan().all()


def test_float_inputs_take_the_native_path() -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    x = torch.rand(3, 4, 5) * 255
    assert same_bits(norm.forward_table(x, torch.float32), norm.forward_native(x, torch.float32))


@pytest.mark.parametrize(
    ("x", "dtype", "layout", "out", "error"),
    [
        (torch.zeros(3, 2, 2, dtype=torch.uint8), torch.int32, "nchw", None, UnsupportedDtypeError),
        (torch.zeros(4, 2, 2, dtype=torch.uint8), torch.bfloat16, "nchw", None, LayoutError),
        (torch.zeros(2, 7, dtype=torch.uint8), torch.bfloat16, "patches", None, LayoutError),
        (
            torch.zeros(2, 6, dtype=torch.uint8),
            torch.bfloat16,
            "patches",
            torch.zeros(2, 6, dtype=torch.float16),
            OutputBufferError,
        ),
    ],
)
def test_errors_match_forward_native(x, dtype, layout, out, error) -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    with pytest.raises(error):
        norm.forward_native(x, dtype, out, layout)
    with pytest.raises(error):
        norm.forward_table(x, dtype, out, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["clip", "one-channel"])
def test_rows_repeated_equal_forward_native_of_the_repeated_rows(
    name: str, dtype: torch.dtype, gen
) -> None:
    """``normalize_rows_by_table``: compact rows looked up and each channel block repeated
    ``times`` times equal ``forward_native`` of the repeated rows, across several row chunks."""
    norm = FusedMMInputNorm(*NORMS[name])
    c, k = norm.num_channels, 20
    g, seed = gen
    wide = pixels((_CHUNK_ROWS * 2 + 37, c * k + 3), g)
    for rows in (wide[:, : c * k], wide[:5, : c * k].contiguous()):  # strided and small
        n = rows.shape[0]
        for times in (1, 2, 3):
            full = rows.reshape(n, c, 1, k).expand(n, c, times, k).reshape(n, c * times * k)
            dst = torch.full((n, c * times * k), float("nan"), dtype=dtype)
            got = normalize_rows_by_table(norm.table(dtype), rows, dst, times=times)
            want = norm.forward_native(full, dtype, layout="patches")
            assert got is dst
            assert same_bits(got, want), f"seed={seed} {name} {n} rows x{times} {dtype}"
