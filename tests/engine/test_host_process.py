"""An Engine embedded in a host application leaves the host's process alone unless its
configuration asks (``aiomm.tuning.tuned``): torch's thread count, glibc's malloc parameters,
Pillow's block cache, numpy's huge pages and the garbage collector are as the host set them while
the engine is open and after it closed.

glibc's malloc thresholds cannot be read back, so every libc function aiomm looks up (mallopt
is reached only that way) is recorded instead."""

from __future__ import annotations

import json

from fresh_python import run_python

_HOST = """
import gc, json, os, sys
import anyio, numpy as np, PIL.Image, torch
from aiomm import Engine, EngineConfig, Request
from aiomm.media.samples import encode, photo_like
from aiomm.tuning import malloc, tuned

looked_up = []
real_lookup = malloc._libc_function
malloc._libc_function = lambda name: looked_up.append(name) or real_lookup(name)

torch.set_num_threads(2)  # the host's own choices
PIL.Image.core.set_blocks_max(1)

def settings():
    return {
        "torch_threads": torch.get_num_threads(),
        "pillow_blocks_max": PIL.Image.core.get_blocks_max(),
        "numpy_hugepage": os.environ.get("NUMPY_MADVISE_HUGEPAGE"),
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "gc_threshold": gc.get_threshold(),
        "switch_interval": sys.getswitchinterval(),
    }

before = settings()
rng = np.random.default_rng(0)
images = [encode(photo_like(rng, 300 + 10 * i, 400), "JPEG") for i in range(6)]
PROMPT = "<|vision_start|><|image_pad|><|vision_end|> describe"

async def main():
    config = CONFIG
    async with Engine.from_pretrained("qwen2-vl", config) as engine:
        requests = [Request(prompt=PROMPT, images=[image]) for image in images]
        async with engine.stream(requests, max_in_flight=4) as results:
            assert all([r.ok async for r in results])
        return settings()

during = anyio.run(main)
print(json.dumps({"before": before, "during": during, "after": settings(),
                  "mallopt": "mallopt" in looked_up, "applied": malloc._applied}))
"""


def _run(config: str) -> dict[str, object]:
    proc = run_python(_HOST.replace("CONFIG", config), unset=("GLIBC_TUNABLES",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_embedded_engine_changes_no_process_wide_setting() -> None:
    seen = _run("EngineConfig(device='cpu', transform_threads=2)")
    assert seen["during"] == seen["before"]
    assert seen["after"] == seen["before"]
    assert seen["mallopt"] is False and seen["applied"] is None


def test_a_tuned_engine_changes_them_while_open_and_puts_them_back() -> None:
    """The same check bites: asked (as ``aiomm serve`` asks), the engine changes them."""
    seen = _run("tuned(EngineConfig(device='cpu', transform_threads=2))")
    during, before = seen["during"], seen["before"]
    assert during["torch_threads"] == 1 != before["torch_threads"]  # type: ignore[index]
    assert during["pillow_blocks_max"] == 8 != before["pillow_blocks_max"]  # type: ignore[index]
    assert seen["after"] == before
    assert seen["mallopt"] is True
