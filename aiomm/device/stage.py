"""The device stage: pixel values -> normalised ``visual_dtype`` on the engine's device.

Input: a request's pixel values on the CPU, as one tensor or as its items' parts (uint8 when
``mm_device_do_normalize`` is on, already normalised floats on the classic path), optionally
compact rows to repeat (``repeat``), and the request's ``NormalizationParams`` (None on the
classic path). The stage's one host copy merges the parts and repeats the rows. Output: a
contiguous ``visual_dtype`` tensor on the device, or the leading rows of a caller-provided
batch-padded ``out``. Runs on the event loop; host copies, launches and every wait for the GPU run
in worker threads. Rows already on the stage's CUDA device (resized there) are merged and
normalised there, with no host copy.

On CUDA, per request:

1. a staging buffer is taken from a :class:`~aiomm.device.pinned_pool.PinnedBufferPool`
   (waiting while all are lent: backpressure) and the pixels are copied into it on the host
   (uint8 stays uint8; the classic path casts to ``visual_dtype`` here, so bf16 crosses instead
   of fp32);
2. one ``non_blocking`` copy to the device on a dedicated copy stream, followed by an event;
3. the fused kernel on a dedicated norm stream that waits for that event (and for an event on
   the caller's stream, so memory the caller recycled or passed as ``out`` is no longer in use),
   writing ``visual_dtype`` into an output allocated under the caller's stream;
4. a worker thread waits for the kernel's event; the staging buffer goes back to the pool only
   once the copy's event has completed, also after an error or a cancellation.

Device tensors live until the events that order their last use have completed (no
``record_stream``). Several requests are in flight at once: the copy of one overlaps the kernel of
another, and decode of others on the CPU. CUDA events time the copy and the kernel.

On a CPU device the same API runs in a worker thread and touches nothing CUDA-specific: uint8
rows are normalised by table lookups and compact rows looked up and repeated in one pass
(:meth:`FusedMMInputNorm.forward_rows` picks the path), into results whose memory is recycled
from dropped results (:class:`~aiomm.device.host_buffers.HostBufferPool`). On CUDA, inputs
larger than one staging buffer may hold are copied from pageable memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from aiomm.device.host_buffers import HostBufferPool, HostBufferPoolStatistics
from aiomm.device.pinned_pool import (
    CudaEventFence,
    PinnedBuffer,
    PinnedBufferPool,
    PinnedPoolStatistics,
)
from aiomm.errors import KernelInputError, OutputBufferError, UnsupportedDtypeError
from aiomm.kernels import OUTPUT_DTYPES, FusedMMInputNorm, expand_repeat
from aiomm.processing.processor import NormalizationParams

__all__ = ("DeviceStage", "DeviceStageStatistics", "resolve_device")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(frozen=True)
class DeviceStageStatistics:
    """A snapshot of a :class:`DeviceStage`; times come from CUDA events (None off CUDA)."""

    device: str
    dtype: str
    #: completed ``run`` calls
    runs: int
    #: host-to-device copies issued, and their bytes
    copies: int
    bytes_copied: int
    #: copies made from pageable memory (input larger than a staging buffer, or no staging)
    pageable_copies: int
    copy_ms_total: float | None
    copy_ms_last: float | None
    kernel_ms_total: float | None
    kernel_ms_last: float | None
    #: staging pool: slots, lent now, tasks waiting (all 0 without a pool)
    pool_capacity: int
    pool_in_use: int
    pool_waiting: int
    pool: PinnedPoolStatistics | None
    #: recycled memory of CPU results (None on CUDA or when off)
    host_outputs: HostBufferPoolStatistics | None = None


class _Done(NamedTuple):
    result: torch.Tensor
    copied_bytes: int
    pageable: bool
    copy_ms: float | None
    kernel_ms: float | None


class DeviceStage:
    """Moves pixel values to the device and normalises (or, classic path, casts) them.

    Knobs: ``staging_buffers`` slots in the staging pool, each ``buffer_bytes`` at first and
    grown up to ``max_buffer_bytes``; ``staging`` (default: on CUDA only) routes inputs through the
    pool, also on the CPU, where it exercises the same accounting; ``timing`` records CUDA events
    for ``copy_ms`` and ``kernel_ms``; ``allocator`` replaces the pool's buffer allocator;
    ``host_output_bytes`` bounds the idle memory recycled for results on a CPU device
    (:class:`~aiomm.device.host_buffers.HostBufferPool`; 0 = every result from torch's allocator).

    :raises UnsupportedDtypeError: for a ``visual_dtype`` the kernel does not write.
    """

    def __init__(
        self,
        device: str,
        visual_dtype: str,
        *,
        staging_buffers: int = 4,
        buffer_bytes: int = 16 << 20,
        max_buffer_bytes: int = 256 << 20,
        staging: bool | None = None,
        timing: bool = True,
        allocator: Callable[[int], torch.Tensor] | None = None,
        host_output_bytes: int = 256 << 20,
    ) -> None:
        self.device = resolve_device(device)
        dtype = getattr(torch, visual_dtype, None)
        if dtype not in OUTPUT_DTYPES:
            raise UnsupportedDtypeError(
                f"visual_dtype {visual_dtype!r} is not supported; expected one of "
                f"{[str(d).removeprefix('torch.') for d in OUTPUT_DTYPES]}"
            )
        self.dtype: torch.dtype = dtype
        self._cuda = self.device.type == "cuda"
        self._timing = timing and self._cuda
        use_pool = self._cuda if staging is None else staging
        #: the stage's worker threads (host copies, launches, waits for the GPU): as many as
        #: staging slots, so CPU and CUDA admit the same work at once
        self.workers = anyio.CapacityLimiter(staging_buffers)
        self.pool: PinnedBufferPool | None = (
            PinnedBufferPool(
                staging_buffers,
                buffer_bytes=buffer_bytes,
                max_buffer_bytes=max_buffer_bytes,
                allocator=allocator,
                pin_memory=self._cuda,
            )
            if use_pool
            else None
        )
        #: recycled memory for results on the CPU (None on CUDA, or when disabled)
        self.host_outputs: HostBufferPool | None = (
            HostBufferPool(host_output_bytes) if not self._cuda and host_output_bytes else None
        )
        self._modules: dict[NormalizationParams, FusedMMInputNorm] = {}
        self._lock = threading.Lock()
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._runs = self._copies = self._bytes = self._pageable = 0
        self._copy_ms = self._kernel_ms = 0.0
        self._copy_last: float | None = None
        self._kernel_last: float | None = None

    @property
    def bytes_moved(self) -> int:
        """Bytes copied from the host to the device so far (0 on the CPU)."""
        return self._bytes

    def statistics(self) -> DeviceStageStatistics:
        pool = None if self.pool is None else self.pool.statistics()
        timed = self._timing
        return DeviceStageStatistics(
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            runs=self._runs,
            copies=self._copies,
            bytes_copied=self._bytes,
            pageable_copies=self._pageable,
            copy_ms_total=self._copy_ms if timed else None,
            copy_ms_last=self._copy_last if timed else None,
            kernel_ms_total=self._kernel_ms if timed else None,
            kernel_ms_last=self._kernel_last if timed else None,
            pool_capacity=0 if pool is None else pool.capacity,
            pool_in_use=0 if pool is None else pool.in_use,
            pool_waiting=0 if pool is None else pool.waiting,
            pool=pool,
            host_outputs=None if self.host_outputs is None else self.host_outputs.statistics(),
        )

    # ------------------------------------------------------------------ run

    async def run(
        self,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        params: NormalizationParams | None,
        *,
        out: torch.Tensor | None = None,
        repeat: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Normalise (or, on the classic path, cast) ``pixel_values`` onto the device.

        ``pixel_values`` is one tensor or a sequence of parts to concatenate along dim 0 (a
        request's per-item rows): the stage's one host copy concatenates them, so a batch is
        never merged in a copy of its own. ``repeat=(blocks, times)``: the parts are compact
        rows ``[n, blocks * width]`` and each block is repeated ``times`` times in the result
        (Qwen-VL's temporal frames), also within that one copy. Inputs normally live on the
        CPU; inputs already on the stage's CUDA device (resized there) are normalised in place
        of a copy. With ``out`` (contiguous, ``visual_dtype``, on the device, the result's row
        shape and at least as many rows) only its leading rows are written and that view is
        returned.

        :raises KernelInputError: ``pixel_values`` on a device other than the CPU or the
            stage's, or parts that cannot be concatenated or expanded; and the kernel's errors
            (``UnsupportedDtypeError``, ``LayoutError``, ``OutputBufferError``).
        """
        x = _Rows.of(pixel_values, repeat)
        resident = x.device.type != "cpu"
        if resident and not (
            self._cuda
            and x.device.type == self.device.type
            and (self.device.index is None or x.device.index == self.device.index)
        ):
            raise KernelInputError(
                f"pixel_values must be on the CPU or on the stage's device {self.device}, got "
                f"{x.device}"
            )
        if out is not None:
            _check_out(out, x, self.dtype, self.device)
        if self._cuda:
            await self._ensure_cuda()
        if x.numel == 0:
            await anyio.lowlevel.checkpoint()
            result = (
                torch.empty(x.shape, dtype=self.dtype, device=self.device)
                if out is None
                else out[: x.shape[0]]
            )
            self._runs += 1
            return result
        if resident:
            consumer = torch.cuda.current_stream(self.device)
            done = await anyio.to_thread.run_sync(
                self._resident_sync, x, params, out, consumer, limiter=self.workers
            )
        elif self._cuda:
            # The caller's stream, read on the caller's thread: the output belongs to it.
            consumer = torch.cuda.current_stream(self.device)
            done = await self._staged(self._cuda_sync, x, params, out, consumer)
        elif self.pool is not None:
            done = await self._staged(self._cpu_staged_sync, x, params, out)
        else:
            done = await anyio.to_thread.run_sync(
                self._cpu_sync, x, params, out, limiter=self.workers
            )
        self._account(done)
        return done.result

    async def _staged(
        self,
        fn: Callable[..., _Done],
        x: _Rows,
        params: NormalizationParams | None,
        out: torch.Tensor | None,
        *args: Any,
    ) -> _Done:
        transfer = x.dtype if params is not None else self.dtype
        nbytes = x.numel * transfer.itemsize
        # *(*args, ...): mypy matches a Callable[..., T] against run_sync's TypeVarTuple only
        # when the starred arguments come last
        if self.pool is None or not self.pool.fits(nbytes):
            return await anyio.to_thread.run_sync(
                fn, x, params, out, *(*args, None), limiter=self.workers
            )
        async with self.pool.lease(nbytes) as buffer:
            return await anyio.to_thread.run_sync(
                fn, x, params, out, *(*args, buffer), limiter=self.workers
            )

    def _account(self, done: _Done) -> None:
        self._runs += 1
        if done.copied_bytes:
            self._copies += 1
            self._bytes += done.copied_bytes
            self._pageable += done.pageable
        if done.copy_ms is not None:
            self._copy_ms += done.copy_ms
            self._copy_last = done.copy_ms
        if done.kernel_ms is not None:
            self._kernel_ms += done.kernel_ms
            self._kernel_last = done.kernel_ms

    def _module(self, params: NormalizationParams) -> FusedMMInputNorm:
        with self._lock:
            module = self._modules.get(params)
            if module is None:
                module = params.module()
                if self._cuda:
                    assert self._streams is not None
                    # Uploaded on the norm stream, so every later kernel there is ordered after it.
                    with torch.cuda.stream(self._streams[1]):
                        module = module.to(self.device)
                    # once per params: the constants are then ready on every stream (the
                    # resident path runs on the caller's)
                    self._streams[1].synchronize()
                self._modules[params] = module
            return module

    # ------------------------------------------------------------------ CPU (worker threads)

    def _cpu_sync(
        self, x: _Rows, params: NormalizationParams | None, out: torch.Tensor | None
    ) -> _Done:
        dst = _output(x, self.dtype, out, self.host_outputs)
        if params is None:
            x.copy_into(dst)
        else:
            module = self._module(params)
            for part, rows in x.slices(dst):
                # the module picks the path: compact uint8 rows are looked up and repeated in
                # one pass over the output
                module.forward_rows(part, self.dtype, rows, params.layout, repeat=x.repeat)
        return _Done(dst, 0, False, None, None)

    def _cpu_staged_sync(
        self,
        x: _Rows,
        params: NormalizationParams | None,
        out: torch.Tensor | None,
        buffer: PinnedBuffer | None,
    ) -> _Done:
        if buffer is None:
            return self._cpu_sync(x, params, out)
        transfer = x.dtype if params is not None else self.dtype
        staging = buffer.view(transfer, x.shape)
        x.copy_into(staging)
        # The staging buffer goes back to the pool: the result must not alias it.
        dst = _output(x, self.dtype, out, self.host_outputs)
        if params is None:
            dst.copy_(staging)
        else:
            self._module(params).forward_table(staging, self.dtype, dst, params.layout)
        return _Done(dst, 0, False, None, None)

    # ------------------------------------------------------------------ CUDA (worker threads)

    def _resident_sync(
        self,
        x: _Rows,
        params: NormalizationParams | None,
        out: torch.Tensor | None,
        consumer: torch.cuda.Stream,
    ) -> _Done:
        """Rows already on the device (resized there): merge + normalise on the caller's
        stream, no host copy. The engine's transform synchronised its stream: they are complete."""
        module = None if params is None else self._module(params)
        with torch.cuda.stream(consumer):
            dst = _output(x, self.dtype, out)
            if module is None or params is None:
                x.copy_into(dst)
            else:
                module.forward(x.cat(x.dtype), self.dtype, dst, params.layout)
            done = torch.cuda.Event()
            done.record(consumer)
        done.synchronize()  # a worker thread: the event loop keeps running
        return _Done(dst, 0, False, None, None)

    async def _ensure_cuda(self) -> None:
        if self._streams is None:
            # CUDA's lazy initialisation takes a while: never on the event loop.
            await anyio.to_thread.run_sync(self._init_cuda, limiter=self.workers)

    def _init_cuda(self) -> None:
        with self._lock:
            if self._streams is None:
                torch.cuda.init()
                copy_stream = torch.cuda.Stream(self.device)
                norm_stream = torch.cuda.Stream(self.device)
                self._streams = (copy_stream, norm_stream)

    def _cuda_sync(
        self,
        x: _Rows,
        params: NormalizationParams | None,
        out: torch.Tensor | None,
        consumer: torch.cuda.Stream,
        buffer: PinnedBuffer | None,
    ) -> _Done:
        assert self._streams is not None
        copy_stream, norm_stream = self._streams
        module = None if params is None else self._module(params)
        transfer = x.dtype if params is not None else self.dtype
        n = x.shape[0]
        timing = self._timing

        def event() -> torch.cuda.Event:
            return torch.cuda.Event(enable_timing=timing)

        # Allocated under the caller's stream, so once the caller frees it the caching allocator
        # reuses it in that stream's order; ``ready`` orders our writes after the caller's work.
        with torch.cuda.stream(consumer):
            dst = (
                torch.empty(x.shape, dtype=self.dtype, device=self.device)
                if out is None
                else out[:n]
            )
            ready = torch.cuda.Event()
            ready.record(consumer)

        if buffer is not None:
            src = buffer.view(transfer, x.shape)
            x.copy_into(src)  # host memcpy (a cast on the classic path) into pinned memory
        else:
            src = x.cat(transfer)
        pinned = buffer is not None and src.is_pinned()
        copy_start, copy_done = event(), event()
        dev_in: torch.Tensor | None = None
        kernel_start = kernel_done = None
        try:
            with torch.cuda.stream(copy_stream):
                if module is None:
                    # The classic path copies straight into ``dst``: after the caller's work.
                    copy_stream.wait_event(ready)
                else:
                    # Allocated on the copy stream; kept alive below until the kernel that
                    # reads it has completed, so its memory is never recycled under the kernel.
                    dev_in = torch.empty(x.shape, dtype=transfer, device=self.device)
                copy_start.record(copy_stream)
                (dst if dev_in is None else dev_in).copy_(src, non_blocking=pinned)
                copy_done.record(copy_stream)
            if buffer is not None:
                buffer.mark_in_flight(CudaEventFence(copy_done))
            last = copy_done
            if module is not None and params is not None:
                assert dev_in is not None
                kernel_start, kernel_done = event(), event()
                norm_stream.wait_event(copy_done)
                norm_stream.wait_event(ready)
                with torch.cuda.stream(norm_stream):
                    kernel_start.record(norm_stream)
                    dst = module.forward(dev_in, self.dtype, dst, params.layout)
                    kernel_done.record(norm_stream)
                last = kernel_done
            last.synchronize()  # a worker thread: the event loop keeps running
        except BaseException:
            # Whatever we enqueued must finish before its tensors can be freed or reused.
            for stream in (copy_stream, norm_stream):
                stream.synchronize()
            raise
        del dev_in
        copy_ms = copy_start.elapsed_time(copy_done) if timing else None
        kernel_ms = (
            kernel_start.elapsed_time(kernel_done)
            if timing and kernel_start is not None and kernel_done is not None
            else None
        )
        return _Done(dst, src.nbytes, not pinned, copy_ms, kernel_ms)


def _check_out(out: torch.Tensor, x: _Rows, dtype: torch.dtype, device: torch.device) -> None:
    """:raises OutputBufferError: ``out`` cannot take ``x``'s rows in ``dtype`` on ``device``."""
    if out.dtype != dtype:
        raise OutputBufferError(f"out has dtype {out.dtype}, visual_dtype is {dtype}")
    if out.device.type != device.type or (
        device.index is not None and out.device.index != device.index
    ):
        raise OutputBufferError(f"out is on {out.device}, the device stage runs on {device}")
    if len(x.shape) == 0 or out.dim() != len(x.shape) or out.shape[1:] != x.shape[1:]:
        raise OutputBufferError(
            f"out has shape {list(out.shape)}; it must be [>= rows, *{list(x.shape[1:])}] "
            f"for pixel_values of shape {list(x.shape)}"
        )
    if out.shape[0] < x.shape[0]:
        raise OutputBufferError(f"out holds {out.shape[0]} rows along dim 0, x needs {x.shape[0]}")
    if not out.is_contiguous():
        raise OutputBufferError("out must be contiguous")


def _output(
    x: _Rows, dtype: torch.dtype, out: torch.Tensor | None, host: HostBufferPool | None = None
) -> torch.Tensor:
    if out is not None:
        return out[: x.shape[0]]
    if host is not None:  # only a CPU stage has one
        return host.empty(x.shape, dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


class _Rows:
    """A run's input: one tensor, or parts concatenated along dim 0, each part's rows expanded
    by ``repeat`` (see ``MultiModalFieldConfig.repeat``); copied part by part."""

    __slots__ = ("device", "dtype", "numel", "parts", "repeat", "shape")

    def __init__(self, parts: list[torch.Tensor], repeat: tuple[int, int] | None) -> None:
        self.parts = parts
        self.repeat = repeat
        first = parts[0]
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        if repeat is not None:
            self.shape = torch.Size((sum(p.shape[0] for p in parts), first.shape[1] * repeat[1]))
        elif len(parts) == 1:
            self.shape = first.shape
        else:
            self.shape = torch.Size((sum(p.shape[0] for p in parts), *first.shape[1:]))
        self.numel: int = self.shape.numel()

    @classmethod
    def of(
        cls,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        repeat: tuple[int, int] | None = None,
    ) -> _Rows:
        """:raises KernelInputError: parts that cannot be concatenated (or expanded)."""
        parts = [pixel_values] if isinstance(pixel_values, torch.Tensor) else list(pixel_values)
        if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
            raise KernelInputError("pixel_values must be a tensor or a non-empty list of tensors")
        first = parts[0]
        for p in parts[1:]:
            if p.dim() == 0 or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
                raise KernelInputError(
                    f"pixel_values parts disagree: {first.dtype} {list(first.shape)} and "
                    f"{p.dtype} {list(p.shape)} cannot be concatenated along dim 0"
                )
            if p.device != first.device:
                raise KernelInputError(
                    f"pixel_values parts are on different devices: {first.device} and {p.device}"
                )
        if len(parts) > 1 and first.dim() == 0:
            raise KernelInputError("pixel_values parts must have at least one dimension")
        if repeat is not None:
            blocks, times = repeat
            if blocks < 1 or times < 1 or first.dim() != 2 or first.shape[1] % blocks:
                raise KernelInputError(
                    f"repeat={repeat} needs rows [n, blocks * width], got {list(first.shape)}"
                )
            if times == 1:
                repeat = None
        return cls(parts, repeat)

    def slices(self, dst: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each part with the rows of ``dst`` it fills."""
        out, start = [], 0
        for p in self.parts:
            n = p.shape[0] if p.dim() else 1
            out.append((p, dst[start : start + n] if p.dim() else dst))
            start += n
        return out

    def fill(self, rows: torch.Tensor, part: torch.Tensor) -> None:
        """Copy one part (or a same-shaped result computed from it) into its rows, expanded."""
        if self.repeat is None:
            rows.copy_(part)
            return
        expanded = expand_repeat(part, self.repeat)
        rows.view(expanded.shape).copy_(expanded)

    def copy_into(self, dst: torch.Tensor) -> None:
        """Copy (casting to ``dst``'s dtype) every part into its rows of ``dst``."""
        for part, rows in self.slices(dst):
            self.fill(rows, part)

    def cat(self, dtype: torch.dtype) -> torch.Tensor:
        """The expanded concatenation in ``dtype``, on the parts' device (a single unexpanded
        part of that dtype: itself)."""
        if len(self.parts) == 1 and self.repeat is None and self.dtype == dtype:
            return self.parts[0]
        dst = torch.empty(self.shape, dtype=dtype, device=self.device)
        self.copy_into(dst)
        return dst
