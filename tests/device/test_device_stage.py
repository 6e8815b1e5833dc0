"""DeviceStage on the CPU: the native norm, the classic cast, ``out=`` buffers, concurrency,
statistics, the staging pool's accounting through the stage, and a free event loop.

``FusedMMInputNorm.forward_native`` is the oracle; one test also checks the float64 reference of
``tests/support/norm_reference.py``. The CUDA tests at the end run only on a CUDA machine.
"""

from __future__ import annotations

import ast
import random
import time
from pathlib import Path

import anyio
import norm_reference
import pytest
import torch
from python_source import parse_file

from aiomm.device.stage import DeviceStage, DeviceStageStatistics
from aiomm.errors import (
    KernelInputError,
    LayoutError,
    OutputBufferError,
    UnsupportedDtypeError,
)
from aiomm.kernels import ChannelLayout, FusedMMInputNorm
from aiomm.kernels import norm as norm_module
from aiomm.processing.processor import NormalizationParams

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CLIP = (1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
SHAPES = {ChannelLayout.PATCHES: (37, 3 * 2 * 14 * 14), ChannelLayout.NCHW: (3, 3, 29, 31)}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def params(layout: ChannelLayout = ChannelLayout.PATCHES) -> NormalizationParams:
    r, mean, std = CLIP
    return NormalizationParams(r, mean, std, layout)


def pixels(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)


def native(x: torch.Tensor, p: NormalizationParams, dtype: torch.dtype) -> torch.Tensor:
    return p.module().forward_native(x, dtype, layout=p.layout)


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
async def test_uint8_equals_forward_native(
    dtype: str, layout: ChannelLayout, staging: bool
) -> None:
    stage = DeviceStage("cpu", {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
                        staging=staging)  # fmt: skip
    p = params(layout)
    x = pixels(SHAPES[layout], seed=hash((dtype, layout.name)) % 1000)
    out = await stage.run(x, p)
    assert out.dtype == DTYPES[dtype] and out.device.type == "cpu" and out.is_contiguous()
    assert torch.equal(out, native(x, p, DTYPES[dtype]))
    assert stage.device == torch.device("cpu") and stage.dtype == DTYPES[dtype]


async def test_matches_float64_reference() -> None:
    ref_module = norm_reference
    p = params(ChannelLayout.PATCHES)
    x = pixels((11, 1176), seed=3)
    for dtype in DTYPES.values():
        out = await DeviceStage("cpu", str(dtype).removeprefix("torch.")).run(x, p)
        ref = ref_module.reference_norm(x, p.rescale_factor, p.image_mean, p.image_std, "patches")
        ref_module.assert_matches_reference(out, ref, f"device stage {dtype}")


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
async def test_classic_path_casts(dtype: str, staging: bool) -> None:
    stage = DeviceStage("cpu", dtype, staging=staging)
    x = pixels((13, 1176), seed=5, dtype=torch.float32)
    out = await stage.run(x, None)
    assert out.dtype == getattr(torch, dtype)
    assert torch.equal(out, x.to(getattr(torch, dtype)))
    assert out.data_ptr() != x.data_ptr()  # never an alias of the caller's (cached) tensor


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("classic", [False, True], ids=["norm", "classic"])
@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda v: v.name)
async def test_out_buffer_writes_only_leading_rows(
    layout: ChannelLayout, classic: bool, staging: bool
) -> None:
    stage = DeviceStage("cpu", "bfloat16", staging=staging)
    p = params(layout)
    shape = SHAPES[layout]
    x = pixels(shape, seed=7, dtype=torch.float32 if classic else torch.uint8)
    out = torch.full((shape[0] + 5, *shape[1:]), float("nan"), dtype=torch.bfloat16)
    got = await stage.run(x, None if classic else p, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == x.shape
    want = x.to(torch.bfloat16) if classic else native(x, p, torch.bfloat16)
    assert torch.equal(out[: shape[0]], want)
    assert bool(out[shape[0] :].isnan().all()), "padding rows were written"


@pytest.mark.parametrize("classic", [False, True], ids=["norm", "classic"])
async def test_out_buffer_errors(classic: bool) -> None:
    stage = DeviceStage("cpu", "bfloat16")
    p = None if classic else params()
    x = pixels((4, 1176), seed=1, dtype=torch.float32 if classic else torch.uint8)
    bad = {
        "dtype": torch.empty(4, 1176, dtype=torch.float16),
        "rows": torch.empty(3, 1176, dtype=torch.bfloat16),
        "shape": torch.empty(4, 588, dtype=torch.bfloat16),
        "strided": torch.empty(1176, 4, dtype=torch.bfloat16).t(),
    }
    for name, out in bad.items():
        with pytest.raises(OutputBufferError):
            await stage.run(x, p, out=out)
        assert stage.statistics().runs == 0, name


async def test_errors() -> None:
    with pytest.raises(UnsupportedDtypeError):
        DeviceStage("cpu", "int8")
    stage = DeviceStage("cpu", "bfloat16", staging=True, staging_buffers=1)
    with pytest.raises(LayoutError):
        await stage.run(pixels((2, 1000), seed=0), params())  # 1000 % 3 != 0
    with pytest.raises(UnsupportedDtypeError):
        await stage.run(torch.zeros(2, 1176, dtype=torch.int32), params())
    assert stage.pool is not None and stage.pool.statistics().in_use == 0
    if torch.cuda.is_available():
        with pytest.raises(KernelInputError, match="CPU tensor"):
            await stage.run(pixels((2, 1176), seed=0).cuda(), params())


async def test_empty_input() -> None:
    stage = DeviceStage("cpu", "float16", staging=True)
    out = await stage.run(torch.empty(0, 1176, dtype=torch.uint8), params())
    assert out.shape == (0, 1176) and out.dtype == torch.float16


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
async def test_concurrent_runs_are_independent(staging: bool) -> None:
    stage = DeviceStage("cpu", "bfloat16", staging=staging, staging_buffers=2, buffer_bytes=4096)
    rng = random.Random(0)
    jobs = []
    for i in range(24):
        layout = rng.choice(list(SHAPES))
        rows = rng.randrange(1, 40)
        shape = (rows, 1176) if layout is ChannelLayout.PATCHES else (rows, 3, 17, 19)
        classic = rng.random() < 0.25
        x = pixels(shape, seed=i, dtype=torch.float32 if classic else torch.uint8)
        jobs.append((x, None if classic else params(layout)))
    results: dict[int, torch.Tensor] = {}

    async def one(i: int) -> None:
        await anyio.sleep(rng.random() * 0.002)
        x, p = jobs[i]
        results[i] = await stage.run(x, p)

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
    for i, (x, p) in enumerate(jobs):
        want = x.to(torch.bfloat16) if p is None else native(x, p, torch.bfloat16)
        assert torch.equal(results[i], want), f"job {i}"
    s = stage.statistics()
    assert s.runs == len(jobs)
    if staging:
        assert s.pool is not None
        assert s.pool.in_use == 0 and s.pool.waiting == 0 and s.pool.peak_in_use <= 2
        assert s.pool.acquisitions == len(jobs)


async def test_statistics_on_cpu() -> None:
    stage = DeviceStage("cpu", "float16")
    s = stage.statistics()
    assert isinstance(s, DeviceStageStatistics)
    assert (s.device, s.dtype, s.runs, s.copies, s.bytes_copied) == ("cpu", "float16", 0, 0, 0)
    for _ in range(3):
        await stage.run(pixels((5, 1176), seed=2), params())
    await stage.run(pixels((5, 1176), seed=2, dtype=torch.float32), None)
    s = stage.statistics()
    assert (s.runs, s.copies, s.bytes_copied, s.pageable_copies) == (4, 0, 0, 0)
    assert stage.bytes_moved == 0
    assert s.copy_ms_total is s.copy_ms_last is s.kernel_ms_total is s.kernel_ms_last is None
    assert (s.pool, s.pool_capacity, s.pool_in_use, s.pool_waiting) == (None, 0, 0, 0)
    with pytest.raises(AttributeError):
        s.runs = 0  # type: ignore[misc]

    staged = DeviceStage("cpu", "float16", staging=True, staging_buffers=3)
    await staged.run(pixels((5, 1176), seed=2), params())
    s = staged.statistics()
    assert (s.pool_capacity, s.pool_in_use, s.pool_waiting) == (3, 0, 0)
    assert s.pool is not None and s.pool.acquisitions == 1 and s.pool.allocated == 1


async def test_staging_pool_is_backpressure() -> None:
    stage = DeviceStage("cpu", "bfloat16", staging=True, staging_buffers=1)
    assert stage.pool is not None
    held = await stage.pool.acquire(16)
    x = pixels((3, 1176), seed=9)
    results: list[torch.Tensor] = []

    async def run() -> None:
        results.append(await stage.run(x, params()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert not results and stage.statistics().pool_waiting == 1
        stage.pool.release(held)
    assert torch.equal(results[0], native(x, params(), torch.bfloat16))


async def test_staging_buffer_returned_after_cancellation() -> None:
    stage = DeviceStage("cpu", "bfloat16", staging=True, staging_buffers=1)
    assert stage.pool is not None
    x = pixels((64, 1176), seed=4)
    # Cancelled while waiting for a buffer ...
    held = await stage.pool.acquire(16)
    with anyio.move_on_after(0.01):
        await stage.run(x, params())
    stage.pool.release(held)
    # ... and while its work runs in the worker thread.
    for delay in (0, 0.0005, 0.002):
        with anyio.move_on_after(delay):
            await stage.run(x, params())
    s = stage.pool.statistics()
    assert (s.in_use, s.waiting, s.in_flight) == (0, 0, 0)
    assert torch.equal(await stage.run(x, params()), native(x, params(), torch.bfloat16))


async def test_oversize_input_bypasses_the_pool() -> None:
    stage = DeviceStage("cpu", "float32", staging=True, buffer_bytes=64, max_buffer_bytes=1024)
    x = pixels((2, 1176), seed=8)  # 2352 bytes > 1024
    out = await stage.run(x, params())
    assert torch.equal(out, native(x, params(), torch.float32))
    assert stage.pool is not None and stage.pool.statistics().acquisitions == 0


async def test_event_loop_stays_free() -> None:
    """A ticker keeps ticking while large runs execute (they run in worker threads)."""
    p = params()
    rows = 2048
    while True:  # size one run to take >= 0.15 s when run synchronously
        x = pixels((rows, 1176), seed=0)
        t = time.perf_counter()
        native(x, p, torch.bfloat16)
        sync_s = time.perf_counter() - t
        if sync_s >= 0.15 or rows >= 65536:
            break
        rows *= 2
    stage = DeviceStage("cpu", "bfloat16")
    lags: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.02)
        for _ in range(3):
            await stage.run(x, p)
        done.set()
    assert len(lags) > 5
    assert max(lags) < max(0.05, sync_s / 2), f"loop lag {max(lags):.3f}s, one run {sync_s:.3f}s"


# ---------------------------------------------------------------------- CUDA only


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
async def test_cuda_matches_native(dtype: str) -> None:
    stage = DeviceStage("cuda", dtype)
    for layout, shape in SHAPES.items():
        p = params(layout)
        x = pixels(shape, seed=11)
        out = torch.full((shape[0] + 2, *shape[1:]), float("nan"), dtype=stage.dtype, device="cuda")
        got = await stage.run(x, p, out=out)
        assert got.is_cuda and torch.equal(got.cpu(), native(x, p, stage.dtype))
        assert bool(out[shape[0] :].isnan().all())
        classic = pixels(shape, seed=12, dtype=torch.float32)
        assert torch.equal((await stage.run(classic, None)).cpu(), classic.to(stage.dtype))
    s = stage.statistics()
    assert s.copies == 4 and s.bytes_copied == stage.bytes_moved > 0 and s.pageable_copies == 0
    assert s.copy_ms_total is not None and s.kernel_ms_total is not None
    assert s.pool is not None and s.pool.pinned and s.pool_in_use == 0


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("classic", [False, True], ids=["norm", "classic"])
@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
async def test_parts_are_concatenated_in_the_stage_copy(
    classic: bool, staging: bool, with_out: bool
) -> None:
    """A request's per-item rows go in as parts: the result is the run on their concatenation."""
    stage = DeviceStage("cpu", "bfloat16", staging=staging)
    p = None if classic else params(ChannelLayout.PATCHES)
    dtype = torch.float32 if classic else torch.uint8
    parts = [pixels((n, 1176), seed=20 + n, dtype=dtype) for n in (3, 1, 8)]
    whole = torch.cat(parts)
    out = torch.full((20, 1176), float("nan"), dtype=torch.bfloat16) if with_out else None
    got = await stage.run(parts, p, out=out)
    want = whole.to(torch.bfloat16) if classic else native(whole, p, torch.bfloat16)
    assert got.shape == whole.shape and got.is_contiguous()
    assert torch.equal(got, want)
    for part in parts:
        assert got.data_ptr() != part.data_ptr()  # the stage never hands back a cached part
    if out is not None:
        assert got.data_ptr() == out.data_ptr() and bool(out[12:].isnan().all())
    assert torch.equal(await stage.run(parts[:1], p), await stage.run(parts[0], p))


async def test_parts_that_cannot_be_concatenated_are_rejected() -> None:
    stage = DeviceStage("cpu", "bfloat16")
    p = params(ChannelLayout.PATCHES)
    with pytest.raises(KernelInputError, match="cannot be concatenated"):
        await stage.run([pixels((2, 1176), 1), pixels((2, 588), 2)], p)
    with pytest.raises(KernelInputError, match="cannot be concatenated"):
        await stage.run([pixels((2, 1176), 1), pixels((2, 1176), 2, torch.float32)], p)
    with pytest.raises(KernelInputError, match="non-empty list"):
        await stage.run([], p)


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("classic", [False, True], ids=["norm", "classic"])
async def test_compact_parts_are_expanded_in_the_copy(classic: bool, staging: bool) -> None:
    """``repeat=(3, 2)``: one-frame rows come out with each channel block twice, as merged."""
    stage = DeviceStage("cpu", "bfloat16", staging=staging)
    p = None if classic else params(ChannelLayout.PATCHES)
    dtype = torch.float32 if classic else torch.uint8
    parts = [pixels((n, 3 * 196), seed=40 + n, dtype=dtype) for n in (4, 2)]
    blocks = torch.cat(parts).reshape(6, 3, 1, 196)
    full = torch.cat([blocks, blocks], dim=2).reshape(6, 1176)
    out = torch.full((9, 1176), float("nan"), dtype=torch.bfloat16)
    got = await stage.run(parts, p, out=out, repeat=(3, 2))
    want = full.to(torch.bfloat16) if classic else native(full, p, torch.bfloat16)
    assert got.shape == (6, 1176) and torch.equal(got, want)
    assert bool(out[6:].isnan().all())
    assert torch.equal(await stage.run(parts, p, repeat=(3, 2)), want)
    with pytest.raises(KernelInputError, match="repeat"):
        await stage.run([pixels((2, 7), 1)], p, repeat=(3, 2))


async def test_compact_uint8_rows_larger_than_a_lookup_chunk() -> None:
    """Compact uint8 rows normalise and repeat in one pass (``normalize_rows_by_table``), rows
    beyond its chunk included; results equal the native normalisation of the merged rows."""
    stage = DeviceStage("cpu", "float32")
    p = params(ChannelLayout.PATCHES)
    parts = [pixels((n, 3 * 196), seed=60 + n) for n in (700, 3, 1300)]
    merged = torch.cat(parts).reshape(-1, 3, 1, 196)
    want = native(merged.expand(-1, 3, 2, 196).reshape(-1, 1176), p, torch.float32)
    assert torch.equal(await stage.run(parts, p, repeat=(3, 2)), want)


@pytest.mark.parametrize("layout", [ChannelLayout.PATCHES, ChannelLayout.NHWC], ids=str)
async def test_cpu_stage_leaves_the_kernel_choice_to_the_module(
    layout: ChannelLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each part goes to ``FusedMMInputNorm.forward_rows`` with the run's ``repeat``; the module
    takes the one-pass table lookup for compact uint8 patch rows (one block per channel) and
    falls back otherwise, with the same results either way."""
    calls: list[tuple[int, tuple[int, int] | None]] = []
    table_passes: list[int] = []
    forward_rows = FusedMMInputNorm.forward_rows
    rows_by_table = norm_module.normalize_rows_by_table

    def spy_rows(self, x, *args, repeat=None):
        calls.append((x.shape[0], repeat))
        return forward_rows(self, x, *args, repeat=repeat)

    def spy_table(table, rows, dst, *, times):
        table_passes.append(rows.shape[0])
        return rows_by_table(table, rows, dst, times=times)

    monkeypatch.setattr(FusedMMInputNorm, "forward_rows", spy_rows)
    monkeypatch.setattr(norm_module, "normalize_rows_by_table", spy_table)
    stage = DeviceStage("cpu", "float32")
    p = params(layout)
    width = 3 * 196 if layout is ChannelLayout.PATCHES else 3
    parts = [pixels((n, width), seed=80 + n) for n in (5, 2)]
    blocks = 3 if layout is ChannelLayout.PATCHES else 1
    got = await stage.run(parts, p, repeat=(blocks, 2))
    merged = torch.cat(parts)
    k = width // blocks
    compact = native(merged, p, torch.float32).reshape(7, blocks, 1, k)
    assert torch.equal(got, compact.expand(7, blocks, 2, k).reshape(7, 2 * width))
    assert calls == [(5, (blocks, 2)), (2, (blocks, 2))]
    assert table_passes == ([5, 2] if layout is ChannelLayout.PATCHES else [])


def test_device_stage_imports_only_the_public_kernels_package() -> None:
    """The stage reaches kernels through ``aiomm.kernels`` alone, never their internals."""
    source = Path(__file__).resolve().parents[2] / "aiomm" / "device" / "stage.py"
    tree = parse_file(source)
    kernel_imports = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiomm.kernels"):
            kernel_imports.add(node.module)
        elif isinstance(node, ast.Import):
            kernel_imports.update(a.name for a in node.names if a.name.startswith("aiomm.kernels"))
    assert kernel_imports == {"aiomm.kernels"}


async def test_cpu_results_recycle_host_memory() -> None:
    """On the CPU, results of a MiB or more come from the stage's ``HostBufferPool``: a result
    dropped by the caller backs the next one, and a result still held is never reused."""
    import gc

    stage = DeviceStage("cpu", "float32")
    p = params(ChannelLayout.PATCHES)
    x = pixels((600, 1176), seed=3)
    first = await stage.run(x, p)
    held = await stage.run(x, p)
    address = first.data_ptr()
    del first
    gc.collect()
    third = await stage.run(x, p)
    assert third.data_ptr() == address and held.data_ptr() != address
    assert torch.equal(held, third) and torch.equal(third, native(x, p, torch.float32))
    stats = stage.statistics().host_outputs
    assert stats is not None and (stats.lent, stats.reused) == (3, 1)
    off = DeviceStage("cpu", "float32", host_output_bytes=0)
    assert off.host_outputs is None and off.statistics().host_outputs is None
