"""Fused normalisation: the Triton kernel and ``forward_native`` against a float64 reference.

CI runs the kernel on the CPU under ``TRITON_INTERPRET=1`` (the real Triton code, interpreted);
with a CUDA device and no interpreter it runs on the device. Inputs are fresh random numbers on
every run; each failure message carries the seed, and ``AIOMM_TEST_SEED=<seed>`` replays it.
The float64 reference lives in ``tests/support/norm_reference.py``, where ``bench/gpu_suite.py``
and ``bench/kernel_bench.py`` import the same copy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
from fresh_python import run_python
from norm_reference import (
    INPUT_DTYPES,
    OUTPUT_DTYPES,
    assert_matches_reference,
    random_pixels,
    reference_norm,
    ulp,
)

from aiomm.errors import KernelInputError, LayoutError, OutputBufferError, UnsupportedDtypeError
from aiomm.kernels import ChannelLayout, FusedMMInputNorm, fused_mm_input_norm_triton

NORM_CONSTANTS = {
    "clip": (1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "imagenet": (1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "half": (1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
# The kernel's small-tensor block: shapes below straddle it (B - 1, B, B + 1 elements or strides).
B = 1024
SHAPES = {
    "nchw": [
        (1, 3, 1, 1),  # one element per channel (channel stride 1)
        (1, 3, 1, B // 3),  # B - 1 elements
        (2, 3, 17, 19),  # primes, stride < B
        (1, 3, 33, 31),  # stride B - 1
        (1, 3, 32, 32),  # stride B
        (1, 3, 25, 41),  # stride B + 1
        (3, 3, 37, 41),  # primes, stride > B
    ],
    "nhwc": [(1, 1, 1, 3), (1, 1, B // 3, 3), (1, 1, B // 3 + 1, 3), (2, 7, 11, 3), (1, 13, 79, 3)],
    "patches": [
        (1, 3),  # one row, one element per channel
        (1, 3 * 2 * 14 * 14),  # one Qwen2-VL patch row
        (7, 3 * 2 * 14 * 14),
        (13, 3 * 2 * 2 * 2),
        (1, 3 * (B // 3)),  # B - 1 elements
        (2, 3 * (B + 1)),  # stride B + 1
    ],
}


@pytest.fixture
def gen() -> tuple[torch.Generator, int]:
    seed = int(os.environ.get("AIOMM_TEST_SEED", time.time_ns() % 2**63))
    return torch.Generator().manual_seed(seed), seed


@pytest.fixture
def device() -> str:
    """Where the Triton kernel runs: the CPU under the interpreter, else a CUDA device."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.fail(
        "the Triton kernel tests need TRITON_INTERPRET=1 (to run the kernel on the CPU) or a "
        "CUDA device; run: TRITON_INTERPRET=1 pytest tests/kernels"
    )


def module(name: str = "clip") -> FusedMMInputNorm:
    r, mean, std = NORM_CONSTANTS[name]
    return FusedMMInputNorm(r, mean, std)


def paths(norm: FusedMMInputNorm, device: str) -> dict[str, Callable[..., torch.Tensor]]:
    """The two implementations under test, each taking and returning CPU tensors."""

    def triton_path(x: torch.Tensor, dtype: torch.dtype, **kw: object) -> torch.Tensor:
        return norm.to(device).forward_cuda(x.to(device), dtype, **kw).cpu()

    def native_path(x: torch.Tensor, dtype: torch.dtype, **kw: object) -> torch.Tensor:
        return norm.cpu().forward_native(x, dtype, **kw)

    return {"triton": triton_path, "native": native_path}


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "patches"])
@pytest.mark.parametrize("out_dtype", OUTPUT_DTYPES, ids=str)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
def test_matches_float64_reference(
    in_dtype: torch.dtype, out_dtype: torch.dtype, layout: str, gen, device: str
) -> None:
    g, seed = gen
    for name, (r, mean, std) in NORM_CONSTANTS.items():
        norm = FusedMMInputNorm(r, mean, std)
        for shape in SHAPES[layout]:
            x = random_pixels(shape, in_dtype, g)
            ref = reference_norm(x, r, mean, std, layout)
            run = paths(norm, device)
            native = run["native"](x, out_dtype, layout=layout)
            what = f"seed={seed} {name} {layout} {list(shape)} {in_dtype}->{out_dtype}"
            assert_matches_reference(native, ref, f"native {what}")
            kern = run["triton"](x, out_dtype, layout=layout)
            assert kern.dtype == out_dtype and kern.is_contiguous()
            assert_matches_reference(kern, ref, f"triton {what}")
            if out_dtype != torch.bfloat16 or device != "cpu":
                # Same fp32 ops in the same order; only the interpreter truncates to bf16.
                assert torch.equal(kern, native), f"triton != native {what}"


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "patches"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
def test_half_outputs_round_to_nearest_even(
    in_dtype: torch.dtype, out_dtype: torch.dtype, layout: str, gen, device: str
) -> None:
    """The kernel's 16-bit output is its own fp32 result rounded to nearest even, bit for bit.

    The Triton interpreter truncates fp32 -> bf16 where a GPU rounds; a truncating kernel is
    within one ulp only by luck (``AIOMM_TEST_SEED=1796069947225276123`` replays the CI run
    where ``test_matches_float64_reference`` caught it).
    """
    g, seed = gen
    norm = module("imagenet")
    run = paths(norm, device)
    for shape in SHAPES[layout]:
        x = random_pixels(shape, in_dtype, g)
        full = run["triton"](x, torch.float32, layout=layout)
        half = run["triton"](x, out_dtype, layout=layout)
        bits = torch.int16
        differ = int((half.view(bits) != full.to(out_dtype).view(bits)).sum())
        assert differ == 0, (
            f"seed={seed} {layout} {list(shape)} {in_dtype}->{out_dtype}: {differ} of "
            f"{half.numel()} elements are not the fp32 result rounded to nearest even"
        )


@pytest.mark.parametrize("out_dtype", OUTPUT_DTYPES, ids=str)
def test_launcher_without_shift_is_an_fma_of_weight_and_bias(
    out_dtype: torch.dtype, gen, device: str
) -> None:
    g, seed = gen
    norm = module("imagenet")
    x = random_pixels((2, 3, 23, 29), torch.uint8, g)
    w, b = norm.weight.to(device), norm.bias.to(device)
    out = fused_mm_input_norm_triton(x.to(device), w, b, visual_dtype=out_dtype).cpu()
    # x * w + b exactly, from the fp32 constants; the kernel adds one fp32 rounding (two when
    # interpreted: numpy has no fma) and the rounding to the output dtype.
    ref = x.double() * norm.weight.double().view(3, 1, 1) + norm.bias.double().view(3, 1, 1)
    fp32_err = 2**-23 * (ref.abs() + norm.bias.double().abs().view(3, 1, 1))
    tol = fp32_err + (0 if out_dtype == torch.float32 else ulp(ref, out_dtype))
    assert ((out.double() - ref).abs() <= tol).all(), f"seed={seed} {out_dtype}"
    r, mean, std = NORM_CONSTANTS["imagenet"]
    if out_dtype == torch.float32:
        assert_matches_reference(out, reference_norm(x, r, mean, std, "nchw"), f"seed={seed}")


@pytest.mark.parametrize("channels", [1, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "patches"])
def test_one_and_four_channels(channels: int, layout: str, gen, device: str) -> None:
    g, seed = gen
    mean = [0.1, 0.7, 0.3, 0.55][:channels]
    std = [0.2, 0.31, 0.25, 0.4][:channels]
    norm = FusedMMInputNorm(1 / 255, mean, std)
    shape = {"nchw": (2, channels, 13, 11), "nhwc": (2, 13, 11, channels)}.get(
        layout, (5, channels * 49)
    )
    x = random_pixels(shape, torch.uint8, g)
    ref = reference_norm(x, 1 / 255, mean, std, layout)
    for path, fn in paths(norm, device).items():
        for dtype in OUTPUT_DTYPES:
            got = fn(x, dtype, layout=layout)
            assert_matches_reference(got, ref, f"{path} seed={seed} C={channels} {layout} {dtype}")


def test_int64_offsets(gen, device: str) -> None:
    """The int64 code path (used from 2**31 elements) computes the same numbers."""
    from aiomm.kernels._triton_norm import _launch

    g, seed = gen
    norm = module().to(device)
    for shape, stride in (((2, 3, 40, 41), 40 * 41), ((2, 3, 7, 11), 77), ((2, 5, 3), 1)):
        x = random_pixels(shape, torch.uint8, g).to(device)
        layout = "nhwc" if stride == 1 else "nchw"
        want = norm.forward_cuda(x, torch.float32, layout=layout)
        got = torch.full_like(want, float("nan"))
        w, b, shift = norm.weight, norm.bias, norm.shift
        _launch(x, got, w, b, shift, stride, block=B, num_warps=4, int64=True)
        assert torch.equal(got, want), f"seed={seed} {list(shape)}"


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "patches"])
@pytest.mark.parametrize("out_dtype", OUTPUT_DTYPES, ids=str)
def test_out_padding_rows_untouched(out_dtype: torch.dtype, layout: str, gen, device: str) -> None:
    g, seed = gen
    norm = module()
    shape = {"nchw": (3, 3, 9, 7), "nhwc": (3, 9, 7, 3)}.get(layout, (5, 3 * 4 * 4))
    x = random_pixels(shape, torch.float16, g)
    n = shape[0]
    for path, fn in {"triton": "forward_cuda", "native": "forward_native"}.items():
        m = norm.to(device)
        out = torch.full((n + 3, *shape[1:]), float("nan"), dtype=out_dtype, device=device)
        got = getattr(m, fn)(x.to(device), out_dtype, out=out, layout=layout)
        expect = getattr(m, fn)(x.to(device), out_dtype, layout=layout)
        what = f"{path} seed={seed} {layout} {out_dtype}"
        assert got.data_ptr() == out.data_ptr() and got.shape == x.shape, what
        assert not out[:n].isnan().any(), f"{what}: a leading element was not written"
        assert torch.equal(out[:n], expect), f"{what}: written rows differ"
        assert out[n:].isnan().all(), f"{what}: a padding row was written"


def test_empty_input(device: str) -> None:
    norm = module().to(device)
    x = torch.zeros((0, 3, 4, 4), dtype=torch.uint8, device=device)
    out = torch.full((2, 3, 4, 4), float("nan"), device=device)
    for fn in (norm.forward_cuda, norm.forward_native):
        assert fn(x, torch.bfloat16).shape == x.shape
        assert fn(x, torch.float32, out=out).shape == x.shape
        assert out.isnan().all()


def test_non_contiguous_input_is_normalised_by_its_logical_layout(gen, device: str) -> None:
    g, seed = gen
    norm = module().to(device)
    base = random_pixels((2, 9, 11, 3), torch.uint8, g).to(device)
    x = base.permute(0, 3, 1, 2)  # NCHW view of NHWC memory
    assert not x.is_contiguous()
    want = norm.forward_native(x.contiguous(), torch.float32)
    for fn in (norm.forward_cuda, norm.forward_native):
        got = fn(x, torch.float32)
        assert got.is_contiguous() and torch.equal(got, want), f"seed={seed} {fn.__name__}"


def test_forward_dispatches_cpu_tensors_off_the_kernel(
    monkeypatch: pytest.MonkeyPatch, gen
) -> None:
    g, _ = gen
    norm = module()

    def no_kernel(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("forward_cuda was called for a CPU tensor")

    monkeypatch.setattr(norm, "forward_cuda", no_kernel)
    x = random_pixels((1, 3, 5, 5), torch.uint8, g)
    assert torch.equal(norm(x, torch.bfloat16), norm.forward_native(x, torch.bfloat16))
    assert torch.equal(
        norm(x.permute(0, 2, 3, 1), torch.float16, layout="NHWC"),
        norm.forward_native(x.permute(0, 2, 3, 1), torch.float16, layout=ChannelLayout.NHWC),
    )
    tables: list[torch.dtype] = []
    table = norm.forward_table
    monkeypatch.setattr(
        norm, "forward_table", lambda x, d, *a: tables.append(x.dtype) or table(x, d, *a)
    )
    norm(x, torch.bfloat16)
    norm(x.float(), torch.bfloat16)
    assert tables == [torch.uint8, torch.float32]  # the table path falls back for floats


def test_layout_parse_and_channel_stride() -> None:
    assert ChannelLayout.parse("NcHw") is ChannelLayout.NCHW
    assert ChannelLayout.parse(ChannelLayout.PATCHES) is ChannelLayout.PATCHES
    assert ChannelLayout.NCHW.channel_stride((2, 3, 5, 7), 3) == 35
    assert ChannelLayout.NHWC.channel_stride((5, 7, 3), 3) == 1
    assert ChannelLayout.PATCHES.channel_stride((10, 1176), 3) == 392
    for layout, shape in (("nchw", (5, 3, 7)), ("nchw", (3, 5)), ("nhwc", (5, 4)), ("nhwc", (3,))):
        with pytest.raises(LayoutError, match=r"(?s)shape.*channel"):
            ChannelLayout.parse(layout).channel_stride(shape, 3)
    with pytest.raises(LayoutError, match="bogus"):
        ChannelLayout.parse("bogus")


def test_module_constants() -> None:
    norm = module("clip")
    r, mean, std = NORM_CONSTANTS["clip"]
    assert norm.weight.dtype == norm.bias.dtype == norm.shift.dtype == torch.float32
    assert norm.num_channels == 3 and norm.state_dict() == {}
    for c in range(3):
        assert norm.weight[c].item() == pytest.approx(r / std[c], rel=1e-7)
        assert norm.bias[c].item() == pytest.approx(-mean[c] / std[c], rel=1e-7)
        shift = norm.shift[0, c].item() + norm.shift[1, c].item()
        assert shift == pytest.approx(mean[c] / r, rel=1e-14, abs=0)
    for args in ((0.0, mean, std), (r, mean, std[:2]), (r, [], []), (r, mean, (0.2, 0.0, 0.3))):
        with pytest.raises(KernelInputError):
            FusedMMInputNorm(*args)


def error_case(
    name: str,
    error: type[Exception],
    fragment: str,
    *,
    shape: tuple[int, ...] = (2, 3, 4, 4),
    x: torch.dtype = torch.uint8,
    to: torch.dtype = torch.bfloat16,
    layout: str = "nchw",
    out: tuple[tuple[int, ...], torch.dtype, bool] | None = None,
):
    """One bad call: ``out`` is (shape, dtype, contiguous); ``fragment`` must be in the message."""
    return pytest.param(shape, x, to, layout, out, error, fragment, id=name)


BF16, OK, STRIDED = torch.bfloat16, True, False
ERROR_CASES = [
    error_case("uint8 out", UnsupportedDtypeError, "visual_dtype", to=torch.uint8),
    error_case("int32 out", UnsupportedDtypeError, "visual_dtype", to=torch.int32),
    error_case("int32 in", UnsupportedDtypeError, "input dtype", x=torch.int32),
    error_case("float64 in", UnsupportedDtypeError, "input dtype", x=torch.float64),
    error_case("out dtype", OutputBufferError, "dtype", out=((2, 3, 4, 4), torch.float16, OK)),
    error_case("out shape", OutputBufferError, "shape", out=((2, 3, 4, 5), BF16, OK)),
    error_case("out ndim", OutputBufferError, "shape", out=((2, 3, 16), BF16, OK)),
    error_case("out too small", OutputBufferError, "rows", out=((1, 3, 4, 4), BF16, OK)),
    error_case("out strided", OutputBufferError, "contiguous", out=((2, 3, 4, 4), BF16, STRIDED)),
    error_case("out device", OutputBufferError, "out is on meta", out=((2, 3, 4, 4), BF16, None)),
    error_case("nchw channels", LayoutError, "NCHW with 3", shape=(1, 4, 4, 4)),
    error_case("nhwc channels", LayoutError, "NHWC with 3", shape=(1, 4, 4, 4), layout="nhwc"),
    error_case("patch row", LayoutError, "divisible by 3", shape=(2, 1177), layout="patches"),
    error_case("layout name", LayoutError, "nhcw", layout="nhcw"),
]


ERROR_ARGS = ("shape", "x_dtype", "to", "layout", "out", "error", "fragment")


@pytest.mark.parametrize(ERROR_ARGS, ERROR_CASES)
def test_errors(shape, x_dtype, to, layout, out, error, fragment, device: str) -> None:
    norm = module().to(device)
    x = torch.ones(shape, dtype=x_dtype, device=device)
    buf = None
    if out is not None:
        out_shape, out_dtype, contiguous = out
        if contiguous is None:  # on another device
            buf = torch.empty(out_shape, dtype=out_dtype, device="meta")
        elif contiguous:
            buf = torch.empty(out_shape, dtype=out_dtype, device=device)
        else:
            buf = torch.empty(out_shape[::-1], dtype=out_dtype, device=device).permute(3, 2, 1, 0)
    for fn in (norm.forward_cuda, norm.forward_native, norm.forward):
        with pytest.raises(error, match=fragment):
            fn(x, to, buf, layout)
    with pytest.raises(error, match=fragment):
        w, b = norm.weight, norm.bias
        fused_mm_input_norm_triton(x, w, b, visual_dtype=to, out=buf, layout=layout)


def test_weight_and_bias_errors(device: str) -> None:
    x = torch.ones((1, 3, 4, 4), dtype=torch.uint8, device=device)
    w = torch.ones(3, device=device)
    bad = {
        "weight length": (torch.ones(4, device=device), w, None),
        "bias length": (w, torch.ones(2, device=device), None),
        "weight dtype": (w.double(), w, None),
        "bias dtype": (w, w.half(), None),
        "weight 2-D": (w.view(1, 3), w, None),
        "shift shape": (w, w, torch.zeros(3, device=device)),
        "bias device": (w, torch.ones(3, device="meta"), None),
    }
    for what, (weight, bias, shift) in bad.items():
        with pytest.raises(KernelInputError) as info:
            fused_mm_input_norm_triton(
                x, weight, bias, visual_dtype=torch.float32, shift=shift, layout="nchw"
            )
        assert type(info.value) is KernelInputError, what
    many = torch.ones(17, device=device)
    x17 = torch.ones((1, 17, 2, 2), dtype=torch.uint8, device=device)
    with pytest.raises(KernelInputError, match="at most 16"):
        fused_mm_input_norm_triton(x17, many, many, visual_dtype=torch.float32)
    wide = FusedMMInputNorm(1.0, [0.0] * 17, [1.0] * 17)
    assert torch.equal(wide(x17.cpu(), torch.float32), torch.ones(1, 17, 2, 2))
    with pytest.raises(KernelInputError, match="device"):
        module().forward_native(torch.ones((1, 3, 2, 2), device="meta"), torch.float32)


def test_kernel_rejects_cpu_tensors_without_interpreter() -> None:
    code = (
        "import torch\n"
        "from aiomm.errors import KernelInputError\n"
        "from aiomm.kernels import FusedMMInputNorm\n"
        "m = FusedMMInputNorm(1 / 255, [0.5] * 3, [0.5] * 3)\n"
        "try:\n"
        "    m.forward_cuda(torch.zeros(1, 3, 2, 2, dtype=torch.uint8), torch.float32)\n"
        "except KernelInputError as e:\n"
        "    print('rejected:', e)\n"
    )
    out = run_python(code, unset=("TRITON_INTERPRET",))
    assert "rejected:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stderr[-2000:]
