"""The CPU table paths, ``forward_table`` and ``forward_rows``: bits of ``forward_native``."""

from __future__ import annotations

import os
import time

import pytest
import torch

from aiomm.errors import KernelInputError, LayoutError, OutputBufferError, UnsupportedDtypeError
from aiomm.kernels import FusedMMInputNorm
from aiomm.kernels import norm as norm_module
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


def expanded(y: torch.Tensor, blocks: int, times: int) -> torch.Tensor:
    """Rows ``[n, blocks * k]`` with each block repeated ``times`` times in place."""
    n, k = y.shape[0], y.shape[1] // blocks
    return y.reshape(n, blocks, 1, k).expand(n, blocks, times, k).reshape(n, blocks * times * k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["clip", "one-channel"])
def test_forward_rows_looks_up_and_repeats_in_one_pass(
    name: str, dtype: torch.dtype, gen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uint8 CPU rows with one block per channel: the table pass writes the repeated rows,
    no compact result in between; bits equal ``forward_native`` of the repeated rows."""
    norm = FusedMMInputNorm(*NORMS[name])
    c, k = norm.num_channels, 14
    g, seed = gen
    wide = pixels((_CHUNK_ROWS + 9, c * k + 5), g)
    calls: list[int] = []

    def spy(*args: object, **kwargs: int) -> torch.Tensor:
        calls.append(kwargs["times"])
        return normalize_rows_by_table(*args, **kwargs)

    monkeypatch.setattr(norm_module, "normalize_rows_by_table", spy)
    monkeypatch.setattr(norm, "forward", lambda *a, **kw: pytest.fail("compact intermediate"))
    cases = {"strided rows": wide[:, : c * k], "contiguous": wide[:3, : c * k].contiguous(),
             "strided elements": pixels((c * k, 6), g).t()}  # fmt: skip
    for what, rows in cases.items():
        n = rows.shape[0]
        for times in (2, 3):
            out = torch.full((n + 2, c * times * k), float("nan"), dtype=dtype)
            got = norm.forward_rows(rows, dtype, out, "patches", repeat=(c, times))
            want = norm.forward_native(expanded(rows, c, times), dtype, layout="patches")
            tag = f"seed={seed} {name} {what} x{times} {dtype}"
            assert got.data_ptr() == out.data_ptr() and same_bits(got, want), tag
            assert out[n:].isnan().all(), f"{tag}: a padding row was written"
            alone = norm.forward_rows(rows, dtype, layout="patches", repeat=(c, times))
            assert same_bits(alone, want), tag
    assert calls == [2, 2, 3, 3] * len(cases)


@pytest.mark.parametrize(
    ("what", "x", "layout", "repeat"),
    [
        ("float rows", torch.rand(5, 3 * 8) * 255, "patches", (3, 2)),
        ("blocks != channels", None, "patches", (6, 2)),
        ("one block", None, "patches", (1, 3)),
        ("nhwc rows", None, "nhwc", (1, 2)),
    ],
)
def test_forward_rows_falls_back_to_forward_then_expands(
    what: str, x: torch.Tensor | None, layout: str, repeat: tuple[int, int], gen
) -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    g, seed = gen
    if x is None:
        x = pixels((7, 3) if layout == "nhwc" else (7, 3 * 8), g)
    blocks, times = repeat
    want = expanded(norm.forward(x, torch.float16, layout=layout), blocks, times)
    got = norm.forward_rows(x, torch.float16, layout=layout, repeat=repeat)
    assert same_bits(got, want), f"seed={seed} {what}"
    out = torch.full((9, want.shape[1]), float("nan"), dtype=torch.float16)
    assert same_bits(norm.forward_rows(x, torch.float16, out, layout, repeat=repeat), want)
    assert out[7:].isnan().all(), what


def test_forward_rows_without_repeat_is_forward() -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    x = pixels((4, 3 * 10), torch.Generator().manual_seed(5))
    want = norm.forward(x, torch.bfloat16, layout="patches")
    for repeat in (None, (3, 1), (1, 1)):
        got = norm.forward_rows(x, torch.bfloat16, layout="patches", repeat=repeat)
        assert same_bits(got, want), repeat


U8, BF16 = torch.zeros(2, 6, dtype=torch.uint8), torch.bfloat16


@pytest.mark.parametrize(
    ("x", "dtype", "out", "repeat", "error", "fragment"),
    [
        (torch.zeros(2, 7, dtype=torch.uint8), BF16, None, (3, 2), KernelInputError,
         r"repeat=\(3, 2\).*\[2, 7\]"),
        (torch.zeros(2, 3, 2, dtype=torch.uint8), BF16, None, (3, 2), KernelInputError, "repeat"),
        (U8, BF16, None, (0, 2), KernelInputError, "counts >= 1"),
        (U8, BF16, None, (3,), KernelInputError, r"\(blocks, times\)"),
        (U8, torch.int32, None, (3, 2), UnsupportedDtypeError, "visual_dtype"),
        (U8, BF16, torch.zeros(2, 6, dtype=BF16), (3, 2), OutputBufferError, r"\[>= 2, 12\]"),
        (U8, BF16, torch.zeros(1, 12, dtype=BF16), (3, 2), OutputBufferError, "rows"),
        (U8.float(), BF16, torch.zeros(2, 12, dtype=torch.float16), (6, 2), OutputBufferError,
         "dtype"),
    ],
)  # fmt: skip
def test_forward_rows_errors(x, dtype, out, repeat, error, fragment) -> None:
    norm = FusedMMInputNorm(*NORMS["clip"])
    with pytest.raises(error, match=fragment):
        norm.forward_rows(x, dtype, out, "patches", repeat=repeat)
