"""Closing the last engine gives memory back and restores the process-wide settings it changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiomm.tuning import malloc as memory

_SCRIPT = """
import anyio, numpy as np, PIL.Image, torch
from aiomm import Engine, EngineConfig, Request
from aiomm.tuning import malloc as memory, tuned
from aiomm.adapters import build_processor
from aiomm.media.samples import encode, photo_like

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

proc = build_processor("qwen2-vl")
rng = np.random.default_rng(0)
imgs = [encode(photo_like(rng, 1200 + 8 * i, 1600), "JPEG") for i in range(16)]
threads, blocks = torch.get_num_threads(), PIL.Image.core.get_blocks_max()
PH = "<|vision_start|><|image_pad|><|vision_end|>"

async def main():
    start = rss()
    # the process-wide settings a program that owns its process asks for
    cfg = tuned(EngineConfig(device="cpu", transform_threads=2, cache_capacity_bytes=0))
    async with Engine(proc, cfg) as first:
        async with Engine(proc, cfg) as second:
            pass  # an engine closing while another is open releases nothing
        assert PIL.Image.core.get_blocks_max() > blocks and memory._applied
        reqs = (Request(prompt=PH, images=[imgs[i % 16]]) for i in range(48))
        async with first.stream(reqs, max_in_flight=8) as results:
            async for r in results:
                assert r.error is None
                del r
        peak = rss()
    closed = rss()
    print(start, peak, closed, torch.get_num_threads() == threads,
          PIL.Image.core.get_blocks_max() == blocks, PIL.Image.core.get_stats()["blocks_cached"],
          memory._applied)

anyio.run(main)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_closing_the_last_engine_gives_memory_back() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    # -P: the repository root (with its top-level kernels/) stays off sys.path
    out = subprocess.run(
        [sys.executable, "-P", "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    start, peak, closed, threads, blocks, cached, applied = out.stdout.split()[-7:]
    grown, kept = int(peak) - int(start), int(closed) - int(start)
    # before: ~70% of the growth stayed (malloc kept 1 GiB at the heap's top, Pillow its blocks)
    assert grown > 50 and kept < 0.25 * grown, (start, peak, closed)
    assert (threads, blocks, cached, applied) == ("True", "True", "0", "None")


def test_release_runs_undos_once_for_the_last_engine() -> None:
    ran: list[str] = []
    memory.engine_opened()
    memory.engine_opened()
    memory.undo_on_last_close("a", lambda: ran.append("a1"))
    memory.undo_on_last_close("a", lambda: ran.append("a2"))  # the first registration wins
    memory.undo_on_last_close("b", lambda: ran.append("b"))
    assert memory.release_after_last_engine() is False and ran == []
    assert memory.release_after_last_engine() is True
    assert ran == ["b", "a1"]  # in reverse order of registration


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc arenas")
def test_worker_threads_leave_a_block_that_the_last_close_frees(monkeypatch) -> None:
    import threading

    freed: list[int] = []
    real = memory._libc_function

    def spying(name: str):  # type: ignore[no-untyped-def]
        function = real(name)
        if name != "free" or function is None:
            return function
        return lambda block: freed.append(block) or function(block)

    monkeypatch.setattr(memory, "_libc_function", spying)
    monkeypatch.setattr(memory, "_applied", True)  # as while an engine has malloc tuned
    memory.engine_opened()
    threads = [threading.Thread(target=memory.mark_thread_arena) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    marks = list(memory._arena_marks)
    assert len(marks) == 3 and all(marks)
    monkeypatch.setattr(memory, "_applied", None)
    assert memory.release_after_last_engine() is True
    assert sorted(freed) == sorted(marks) and memory._arena_marks == []
