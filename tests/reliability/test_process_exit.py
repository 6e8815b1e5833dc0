"""A program that uses an Engine exits on its own, whether or not it closed the engine: nothing
aiomm starts keeps the interpreter alive after its owner is done."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
from fresh_python import run_python

from aiomm.engine._worker_pool import WorkerPool

_PROMPT = "<|vision_start|><|image_pad|><|vision_end|> describe"

NEVER_CLOSED = f"""
import anyio, numpy as np
from aiomm import Engine, Request

async def main():
    engine = Engine.from_pretrained("qwen2-vl")
    await engine.__aenter__()
    image = np.full((96, 128, 3), 7, np.uint8)
    result = await engine.process(Request(prompt={_PROMPT!r}, images=[image]))
    print("processed", len(result.prompt_token_ids), flush=True)
    # returns without aclose(): the interpreter must still exit

anyio.run(main)
"""

RAISES_MID_STREAM = f"""
import anyio, numpy as np
from aiomm import Engine, Request

class Boom(Exception):
    pass

async def main():
    requests = [
        Request(prompt={_PROMPT!r}, images=[np.full((64 + i, 96, 3), i, np.uint8)])
        for i in range(40)
    ]
    async with Engine.from_pretrained("qwen2-vl") as engine:
        async with engine.stream(requests, max_in_flight=8) as results:
            seen = 0
            async for _ in results:
                seen += 1
                if seen == 5:
                    print("raising after", seen, flush=True)
                    raise Boom("halfway")

try:
    anyio.run(main)
except Boom:
    print("caught", flush=True)
"""


def _exits_within(code: str, seconds: float) -> str:
    t0 = time.monotonic()
    proc = run_python(code, timeout=seconds + 120)  # model build and imports take their time
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < seconds + 60, f"exited after {elapsed:.1f} s"
    return proc.stdout


def test_a_program_that_never_closes_its_engine_exits() -> None:
    out = _exits_within(NEVER_CLOSED, 60)
    assert "processed" in out


def test_a_program_raising_out_of_a_stream_inside_async_with_exits() -> None:
    out = _exits_within(RAISES_MID_STREAM, 60)
    assert "raising after 5" in out and "caught" in out


async def test_worker_threads_are_daemons_and_end_when_an_unclosed_pool_is_collected() -> None:
    """A host that drops an engine unclosed gets its idle threads back."""
    pool = WorkerPool(2, "aiomm-unclosed")
    assert await pool.run(lambda: np.ones(3).sum()) == 3.0
    threads = [t for t in threading.enumerate() if t.name.startswith("aiomm-unclosed")]
    assert len(threads) == 2 and all(t.daemon for t in threads)
    del pool
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
