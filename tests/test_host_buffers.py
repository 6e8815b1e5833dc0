"""``HostBufferPool``: recycled memory for large CPU results, returned only when unused."""

from __future__ import annotations

import gc
import resource
import threading

import pytest
import torch

from aiomm.device.host_buffers import HostBufferPool, _block_size

MIB = 1 << 20


def test_tensors_have_the_asked_shape_dtype_and_are_writable() -> None:
    pool = HostBufferPool(64 * MIB)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8):
        t = pool.empty((1000, 1176), dtype)
        assert t.shape == (1000, 1176) and t.dtype == dtype and t.is_contiguous()
        t.fill_(3)
        assert bool((t == 3).all())
    assert pool.statistics().lent == 4


def test_memory_is_reused_once_the_last_view_is_gone() -> None:
    pool = HostBufferPool(64 * MIB)
    a = pool.empty((4 * MIB,), torch.uint8)
    view = a[10:20]  # a view keeps the memory in use after ``a`` goes
    address = a.data_ptr()
    del a
    gc.collect()
    b = pool.empty((4 * MIB,), torch.uint8)
    assert b.data_ptr() != address, "memory still viewed was lent again"
    view.fill_(7)
    b.fill_(1)
    assert bool((view == 7).all())
    del view
    gc.collect()
    c = pool.empty((4 * MIB - 4096,), torch.uint8)  # a nearby size shares the block
    assert c.data_ptr() == address
    stats = pool.statistics()
    assert (stats.lent, stats.reused, stats.blocks_created) == (3, 1, 2)


def test_numpy_views_keep_the_memory_in_use() -> None:
    pool = HostBufferPool(64 * MIB)
    t = pool.empty((2 * MIB,), torch.float32)
    array = t.numpy()
    address = t.data_ptr()
    del t
    gc.collect()
    assert pool.empty((2 * MIB,), torch.float32).data_ptr() != address
    array[:] = 5  # still ours to write
    assert array.sum() == 5 * 2 * MIB


def test_reused_memory_takes_no_page_faults() -> None:
    """The point of the pool: a second result of the same size lands in pages already mapped."""
    pool = HostBufferPool(256 * MIB)
    size = (16 * MIB,)  # 64 MiB of float32: beyond glibc's largest mmap threshold

    def faults_of_one_result() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = pool.empty(size, torch.float32)
        t.fill_(1.0)
        del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    first = faults_of_one_result()
    again = faults_of_one_result()
    pages = 64 * MIB // 4096
    assert first > pages // 600  # the first fill maps the block (2 MiB pages where allowed)
    assert again < pages // 100, (first, again)


def test_idle_memory_is_bounded() -> None:
    pool = HostBufferPool(10 * MIB)
    held = [pool.empty((4 * MIB,), torch.uint8) for _ in range(4)]
    del held
    gc.collect()
    stats = pool.statistics()
    assert stats.idle_bytes <= 10 * MIB and stats.idle_blocks == 2
    pool.clear()
    assert pool.statistics().idle_bytes == 0


def test_small_requests_and_a_zero_bound_use_torch() -> None:
    pool = HostBufferPool(64 * MIB, min_bytes=MIB)
    pool.empty((100,), torch.float32)
    HostBufferPool(0).empty((4 * MIB,), torch.uint8)
    stats = pool.statistics()
    assert stats.small == 1 and stats.lent == 0
    with pytest.raises(ValueError, match="max_idle_bytes"):
        HostBufferPool(-1)


def test_freed_in_other_threads() -> None:
    pool = HostBufferPool(512 * MIB)
    tensors = [pool.empty((2 * MIB,), torch.uint8) for _ in range(32)]
    chunks = [tensors[i::4] for i in range(4)]
    del tensors

    def drop(chunk: list[torch.Tensor]) -> None:
        chunk.clear()

    threads = [threading.Thread(target=drop, args=(c,)) for c in chunks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    stats = pool.statistics()
    assert stats.idle_blocks == 32 and stats.idle_bytes == 32 * _block_size(2 * MIB)
    again = [pool.empty((2 * MIB,), torch.uint8) for _ in range(32)]
    assert len({t.data_ptr() for t in again}) == 32
    assert pool.statistics().reused == 32


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, MIB, MIB + 1, 5 * MIB + 3, 100 * MIB - 7])
def test_block_sizes_hold_the_request_and_waste_at_most_a_quarter(nbytes: int) -> None:
    size = _block_size(nbytes)
    assert size >= nbytes and size % 4096 == 0
    assert nbytes < 4 * 4096 or size <= nbytes * 1.25 + 4096


def test_tensors_pickle_and_move_to_shared_memory() -> None:
    """Serving stacks hand results to other processes: pickling copies the values, and
    ``share_memory_`` moves them to shared memory, after which the block is free again."""
    import pickle

    pool = HostBufferPool(64 * MIB)
    t = pool.empty((1000, 1176), torch.float32)
    t.fill_(2.5)
    assert torch.equal(pickle.loads(pickle.dumps(t)), t)
    address = t.data_ptr()
    t.share_memory_()
    assert t.is_shared() and t.data_ptr() != address and bool((t == 2.5).all())
    gc.collect()
    assert pool.empty((1000, 1176), torch.float32).data_ptr() == address
    with pytest.raises(RuntimeError, match="not resizable"):
        t2 = pool.empty((1000, 1176), torch.float32)
        t2.resize_(2000, 1176)
