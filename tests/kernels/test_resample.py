"""Bit-exact uint8 bicubic resize: the Triton passes and the torch reference against the libraries.

The oracles are the libraries themselves: ``PIL.Image.resize(..., BICUBIC)`` of the installed
Pillow (modes L and RGB) and ``torchvision.transforms.v2.functional.resize`` on uint8 with
antialias (bicubic). CI runs the Triton passes on the CPU under ``TRITON_INTERPRET=1``, so those
pairs are small (sides <= 40: 300 random pairs per variant, plus 1-pixel sides and Pillow 13's
pass-order boundary); the reference alone is also checked on larger sizes. Pairs are fresh random
numbers on every run; each failure message carries the seed.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable

import numpy as np
import PIL
import PIL.Image
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from fresh_python import run_python
from torchvision.transforms import InterpolationMode

from aiomm.errors import KernelInputError, LayoutError, UnsupportedDtypeError
from aiomm.kernels import (
    ImageLayout,
    ResampleVariant,
    _triton_resample,
    resample_uint8_triton,
    resize_coefficients,
    resize_uint8,
    resize_uint8_reference,
)
from aiomm.kernels.resample import pass_order

PIL_V, TORCH_V = ResampleVariant.PIL_BICUBIC, ResampleVariant.TORCH_BICUBIC_AA
VARIANTS = (PIL_V, TORCH_V)
TRITON_PAIRS = 300  # per variant, each checked through the reference and the Triton passes
TRITON_MAX_SIDE = 40
LARGE_PAIRS = 25  # per variant, reference only
LARGE_MAX_SIDE = 500


def pil_resize(hwc: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """``PIL.Image.resize((out_w, out_h), BICUBIC)`` of an ``[H, W, 1 | 3]`` uint8 image (L/RGB)."""
    array = hwc.numpy()
    pil = PIL.Image.fromarray(array[..., 0] if hwc.shape[-1] == 1 else array)
    out = np.array(pil.resize((out_w, out_h), PIL.Image.Resampling.BICUBIC))
    return torch.from_numpy(out.reshape(out_h, out_w, hwc.shape[-1]))


def torchvision_resize(chw: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """``torchvision.transforms.v2.functional.resize``, bicubic with antialias, of a CHW image.

    torch's AVX2 uint8 kernel trips an internal assert for a 1x1 output of more than one channel;
    there the channels go one at a time (the kernel is per channel).
    """
    if (out_h, out_w) == (1, 1) and chw.shape[0] > 1:
        return torch.cat([torchvision_resize(chw[i : i + 1], 1, 1) for i in range(chw.shape[0])])
    out = TF.resize(chw, [out_h, out_w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return out.contiguous()


def library_resize(
    variant: ResampleVariant, hwc: torch.Tensor, out_h: int, out_w: int
) -> torch.Tensor:
    """The library result of ``variant`` as ``[out_h, out_w, C]``."""
    if variant is PIL_V:
        return pil_resize(hwc, out_h, out_w)
    return torchvision_resize(hwc.permute(2, 0, 1).contiguous(), out_h, out_w).permute(1, 2, 0)


def to_layout(hwc: torch.Tensor, layout: str) -> torch.Tensor:
    return hwc if layout == "hwc" else hwc.permute(2, 0, 1).contiguous()


def assert_equal(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.uint8, f"{what}: dtype {out.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {list(out.shape)} != {list(ref.shape)}"
    if not torch.equal(out, ref):
        diff = (out.int() - ref.int()).abs()
        i = int(torch.nonzero(diff.reshape(-1))[0])
        raise AssertionError(
            f"{what}: {int((diff > 0).sum())} of {out.numel()} pixels differ (max "
            f"{int(diff.max())}); first at flat index {i}: {int(out.reshape(-1)[i])} != "
            f"{int(ref.reshape(-1)[i])}"
        )


@pytest.fixture
def rng() -> tuple[random.Random, int]:
    seed = int(os.environ.get("AIOMM_TEST_SEED", time.time_ns() % 2**63))
    return random.Random(seed), seed


@pytest.fixture
def device() -> str:
    """Where the Triton passes run: the CPU under the interpreter, else a CUDA device."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.fail(
        "the Triton kernel tests need TRITON_INTERPRET=1 (to run the kernels on the CPU) or a "
        "CUDA device; run: TRITON_INTERPRET=1 pytest tests/kernels"
    )


def paths(device: str) -> dict[str, Callable[..., torch.Tensor]]:
    """The implementations under test, each taking and returning CPU tensors."""

    def triton_path(x: torch.Tensor, out_h: int, out_w: int, variant, layout) -> torch.Tensor:
        return resample_uint8_triton(x.to(device), out_h, out_w, variant, layout=layout).cpu()

    def reference_path(x: torch.Tensor, out_h: int, out_w: int, variant, layout) -> torch.Tensor:
        return resize_uint8_reference(x, out_h, out_w, variant, layout=layout)

    return {"triton": triton_path, "reference": reference_path}


def random_side(rng: random.Random, max_side: int) -> int:
    """1-pixel and tiny sides often, else uniform."""
    r = rng.random()
    if r < 0.1:
        return 1
    if r < 0.2:
        return rng.randint(2, 4)
    return rng.randint(1, max_side)


def random_image(rng: random.Random, h: int, w: int, c: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    return torch.randint(0, 256, (h, w, c), dtype=torch.uint8, generator=gen)


def check_case(
    run: dict[str, Callable[..., torch.Tensor]],
    variant: ResampleVariant,
    hwc: torch.Tensor,
    out_h: int,
    out_w: int,
    layout: str,
    what: str,
) -> None:
    expected = to_layout(library_resize(variant, hwc, out_h, out_w), layout)
    x = to_layout(hwc, layout)
    order = pass_order(hwc.shape[0], hwc.shape[1], out_h, out_w, variant)
    for name, fn in run.items():
        out = fn(x, out_h, out_w, variant, layout)
        assert out.is_contiguous(), f"{name} {what}"
        assert_equal(out, expected, f"{name} {what} passes={order}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.value)
def test_random_pairs_match_the_library(variant: ResampleVariant, rng, device: str) -> None:
    r, seed = rng
    run = paths(device)
    orders: set[tuple[str, ...]] = set()
    for i in range(TRITON_PAIRS):
        in_h, in_w, out_h, out_w = (random_side(r, TRITON_MAX_SIDE) for _ in range(4))
        c = r.choice((1, 3))
        layout = ("hwc", "chw")[i % 2]
        hwc = random_image(r, in_h, in_w, c)
        orders.add(pass_order(in_h, in_w, out_h, out_w, variant))
        what = f"seed={seed} #{i} {variant.value} {in_h}x{in_w}x{c} -> {out_h}x{out_w} {layout}"
        check_case(run, variant, hwc, out_h, out_w, layout, what)
    expected = {("h", "v"), ("h",), ("v",)} | ({("v", "h")} if variant is PIL_V else set())
    assert expected <= orders, f"seed={seed}: pass orders seen {orders}"


# (in_h, in_w, out_h, out_w): every 1-pixel side, in and out, with up- and down-scaling.
ONE_PIXEL_CASES = [
    (1, 1, 1, 1),
    (1, 1, 1, 7),
    (1, 1, 7, 1),
    (1, 1, 5, 6),
    (1, 9, 1, 4),
    (1, 9, 3, 1),
    (9, 1, 4, 1),
    (9, 1, 1, 3),
    (9, 7, 1, 1),
    (9, 7, 1, 11),
    (9, 7, 13, 1),
    (2, 2, 1, 1),
    (1, 40, 40, 1),
    (40, 1, 1, 40),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.value)
def test_one_pixel_sides(variant: ResampleVariant, rng, device: str) -> None:
    r, seed = rng
    run = paths(device)
    for in_h, in_w, out_h, out_w in ONE_PIXEL_CASES:
        for c, layout in ((1, "hwc"), (3, "hwc"), (3, "chw")):
            hwc = random_image(r, in_h, in_w, c)
            what = f"seed={seed} {variant.value} {in_h}x{in_w}x{c} -> {out_h}x{out_w} {layout}"
            check_case(run, variant, hwc, out_h, out_w, layout, what)


def boundary_cases() -> list[tuple[int, int, int, int]]:
    """Pairs around Pillow 13's rule ``in_h - out_h > 2 * (in_w - out_w)`` (height shrinking)."""
    cases = []
    for in_w, out_w in ((20, 15), (31, 17), (12, 11), (9, 14), (3, 1)):
        for delta in (-1, 0, 1):
            shrink = max(2 * (in_w - out_w), 0) + delta
            for out_h in (3, 11):
                if shrink > 0:
                    cases.append((out_h + shrink, in_w, out_h, out_w))
    # Ratios at the boundary (in_h / out_h == 2 * in_w / out_w) where the pixel counts are not.
    cases += [(40, 20, 10, 10), (36, 30, 9, 15), (24, 5, 3, 1)]
    return cases


def test_pass_order_rule() -> None:
    for variant in VARIANTS:
        assert pass_order(7, 7, 7, 7, variant) == ()
        assert pass_order(7, 7, 7, 3, variant) == ("h",)
        assert pass_order(7, 7, 3, 7, variant) == ("v",)
        assert pass_order(40, 40, 5, 40, variant) == ("v",)
    pil13 = {"pillow_version": (13, 0, 0)}
    for in_h, in_w, out_h, out_w in boundary_cases():
        vertical_first = in_h - out_h > 2 * (in_w - out_w)
        expected = ("v", "h") if vertical_first else ("h", "v")
        assert pass_order(in_h, in_w, out_h, out_w, PIL_V, **pil13) == expected
        assert pass_order(in_h, in_w, out_h, out_w, PIL_V, pillow_version=(12, 3)) == ("h", "v")
        assert pass_order(in_h, in_w, out_h, out_w, TORCH_V) == ("h", "v")
    # The rule counts pixels, not ratios: a height halving against a wider upscale goes vertical.
    assert pass_order(30, 10, 15, 40, PIL_V, **pil13) == ("v", "h")
    assert pass_order(48, 60, 10, 38, PIL_V, **pil13) == ("h", "v")  # ratios 4.8 > 2 * 1.58
    installed = tuple(int(p) for p in PIL.__version__.split(".")[:2])
    assert pass_order(30, 10, 15, 40, PIL_V) == pass_order(
        30, 10, 15, 40, PIL_V, pillow_version=installed
    )


def test_pass_order_boundary_matches_pillow(rng, device: str) -> None:
    r, seed = rng
    run = paths(device)
    cases = boundary_cases()
    decisive = 0
    for in_h, in_w, out_h, out_w in cases:
        hwc = random_image(r, in_h, in_w, 3)
        what = f"seed={seed} {in_h}x{in_w} -> {out_h}x{out_w}"
        for layout in ("hwc", "chw"):
            check_case(run, PIL_V, hwc, out_h, out_w, layout, f"{what} {layout}")
        # Is the case decisive: does the other pass order give another image?
        order = pass_order(in_h, in_w, out_h, out_w, PIL_V)
        other = "v" if order[0] == "h" else "h"
        first = resize_uint8_reference(
            hwc, *((in_h, out_w) if other == "h" else (out_h, in_w)), PIL_V
        )
        swapped = resize_uint8_reference(first, out_h, out_w, PIL_V)
        decisive += not torch.equal(swapped, pil_resize(hwc, out_h, out_w))
    # Random images make almost every case decisive; a few ties are expected.
    assert decisive >= len(cases) // 2, f"seed={seed}: only {decisive} of {len(cases)} decisive"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.value)
def test_reference_matches_the_library_on_larger_images(variant: ResampleVariant, rng) -> None:
    r, seed = rng
    run = {"reference": paths("cpu")["reference"]}
    for i in range(LARGE_PAIRS):
        in_h, in_w, out_h, out_w = (random_side(r, LARGE_MAX_SIDE) for _ in range(4))
        layout = ("hwc", "chw")[i % 2]
        hwc = random_image(r, in_h, in_w, 3)
        what = f"seed={seed} #{i} {variant.value} {in_h}x{in_w} -> {out_h}x{out_w} {layout}"
        check_case(run, variant, hwc, out_h, out_w, layout, what)
    # Strong reductions (wide supports, many taps) and a large upscale.
    for in_h, in_w, out_h, out_w in ((997, 13, 5, 3), (7, 600, 9, 2), (12, 9, 480, 331)):
        hwc = random_image(r, in_h, in_w, 3)
        what = f"seed={seed} {variant.value} {in_h}x{in_w} -> {out_h}x{out_w}"
        check_case(run, variant, hwc, out_h, out_w, "hwc", what)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.value)
def test_triton_tiles_smaller_than_the_image(
    variant: ResampleVariant, rng, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiles of at most 64 elements: many row and column blocks per pass, with ragged edges, and
    # rows longer than a tile.
    monkeypatch.setattr(_triton_resample, "_MAX_TILE", 64)
    r, seed = rng
    run = paths(device)
    for i in range(8):
        in_h, in_w, out_h, out_w = (r.randint(1, 40) for _ in range(4))
        layout = ("hwc", "chw")[i % 2]
        hwc = random_image(r, in_h, in_w, 3)
        what = f"seed={seed} #{i} {variant.value} {in_h}x{in_w} -> {out_h}x{out_w} {layout}"
        check_case(run, variant, hwc, out_h, out_w, layout, what)


@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_batches_channels_and_strides(layout: str, rng, device: str) -> None:
    r, seed = rng
    run = paths(device)
    for c in (1, 2, 3, 4):
        batch = torch.stack([random_image(r, 13, 17, c) for _ in range(3)])  # [3, 13, 17, c]
        x = batch if layout == "hwc" else batch.permute(0, 3, 1, 2).contiguous()
        for variant in VARIANTS:
            each = torch.stack(
                [resize_uint8_reference(i, 9, 23, variant, layout=layout) for i in x]
            )
            for name, fn in run.items():
                what = f"seed={seed} {name} {variant.value} c={c} {layout}"
                assert_equal(fn(x, 9, 23, variant, layout), each, f"batch {what}")
                # A strided view (every other column) is resized like its contiguous copy.
                view = x[..., ::2, :] if layout == "hwc" else x[..., ::2]
                expected = fn(view.contiguous(), 5, 4, variant, layout)
                assert_equal(fn(view, 5, 4, variant, layout), expected, f"strided {what}")
                if c in (1, 3):
                    one = batch[1]
                    lib = to_layout(library_resize(variant, one, 9, 23), layout)
                    assert_equal(each[1], lib, f"library {what}")


def test_same_size_is_a_copy(device: str) -> None:
    x = torch.arange(60, dtype=torch.uint8).reshape(4, 5, 3)
    for variant in VARIANTS:
        for fn in (resize_uint8_reference, resize_uint8):
            out = fn(x, 4, 5, variant, layout="hwc")
            assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
        out = resample_uint8_triton(x.to(device), 4, 5, variant).cpu()
        assert torch.equal(out, x)


def test_resize_uint8_runs_the_reference_on_cpu_tensors(rng) -> None:
    r, _ = rng
    hwc = random_image(r, 21, 8, 3)
    for variant in VARIANTS:
        out = resize_uint8(hwc, 5, 12, variant, layout=ImageLayout.HWC)
        assert torch.equal(out, resize_uint8_reference(hwc, 5, 12, variant))
        assert torch.equal(out, library_resize(variant, hwc, 5, 12))
        assert torch.equal(resize_uint8(hwc, 5, 12, variant.value.upper(), layout="HWC"), out)


def test_coefficients() -> None:
    for variant in VARIANTS:
        for in_size, out_size in ((1, 1), (1, 9), (9, 1), (10, 3), (3, 10), (640, 224)):
            coeffs = resize_coefficients(in_size, out_size, variant)
            assert coeffs is resize_coefficients(in_size, out_size, variant)  # cached
            bounds, weights, precision = coeffs
            assert bounds.dtype == weights.dtype == torch.int32
            assert bounds.shape == (out_size, 2) and weights.shape[0] == out_size
            assert weights.shape[1] >= int(bounds[:, 1].max())
            assert (bounds[:, 0] >= 0).all() and (bounds.sum(1) <= in_size).all()
            taps = torch.arange(weights.shape[1])[None, :] < bounds[:, 1:]
            assert (weights[~taps] == 0).all()
            # Normalised weights: each row sums to 1.0 up to one rounding per tap.
            err = (weights.sum(1) - (1 << precision)).abs()
            assert (err <= bounds[:, 1]).all(), (variant, in_size, out_size)
    assert resize_coefficients(640, 224, PIL_V).precision == 22
    # torch: the largest precision whose doubled maximum weight still fits an int16.
    for in_size, out_size in ((640, 224), (3, 10), (5, 5 * 7)):
        bounds, weights, precision = resize_coefficients(in_size, out_size, TORCH_V)
        assert int(weights.max()) < 2**15 and precision <= 22
        assert precision == 22 or 2 * int(weights.max()) + 2 >= 2**15
    with pytest.raises(KernelInputError, match="in_size"):
        resize_coefficients(0, 5, PIL_V)
    with pytest.raises(KernelInputError, match="out_size"):
        resize_coefficients(5, -1, PIL_V)
    with pytest.raises(KernelInputError, match="variant"):
        resize_coefficients(5, 4, "lanczos")


ERROR_CASES = [
    pytest.param((4, 4, 3), torch.float32, "hwc", 2, 2, UnsupportedDtypeError, "uint8", id="dtype"),
    pytest.param((4, 4), torch.uint8, "hwc", 2, 2, LayoutError, "ndim >= 3", id="2-D"),
    pytest.param((4, 4, 3), torch.uint8, "nhwc", 2, 2, LayoutError, "nhwc", id="layout"),
    pytest.param((0, 4, 3), torch.uint8, "hwc", 2, 2, KernelInputError, "empty", id="empty"),
    pytest.param((4, 4, 3), torch.uint8, "hwc", 0, 2, KernelInputError, "out_h", id="out_h"),
    pytest.param((4, 4, 3), torch.uint8, "chw", 2, 2.5, KernelInputError, "out_w", id="out_w"),
]


@pytest.mark.parametrize(
    ("shape", "dtype", "layout", "out_h", "out_w", "error", "match"), ERROR_CASES
)
def test_errors(shape, dtype, layout, out_h, out_w, error, match, device: str) -> None:
    x = torch.zeros(shape, dtype=dtype)
    for fn in (resize_uint8_reference, resize_uint8, resample_uint8_triton):
        with pytest.raises(error, match=match):
            fn(
                x.to(device) if fn is resample_uint8_triton else x,
                out_h,
                out_w,
                PIL_V,
                layout=layout,
            )
    with pytest.raises(KernelInputError, match="variant"):
        resize_uint8_reference(torch.zeros(4, 4, 3, dtype=torch.uint8), 2, 2, "bilinear")


def test_triton_rejects_cpu_tensors_without_interpreter() -> None:
    code = (
        "import torch\n"
        "from aiomm.errors import KernelInputError\n"
        "from aiomm.kernels import resample_uint8_triton\n"
        "try:\n"
        "    resample_uint8_triton(torch.zeros(4, 4, 3, dtype=torch.uint8), 2, 2, 'pil_bicubic')\n"
        "except KernelInputError as e:\n"
        "    print('rejected:', e)\n"
    )
    out = run_python(code, unset=("TRITON_INTERPRET",))
    assert "rejected:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stderr[-2000:]
