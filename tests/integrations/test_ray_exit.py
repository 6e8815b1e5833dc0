"""After a Ray Data job with :class:`ImagePreprocessor` and ``ray.shutdown()``, no actor process
of it remains (each holds an engine and ~900 MB; an unclosed engine used to keep it alive)."""

from __future__ import annotations

import re
import tempfile

import pytest
from fresh_python import run_python

JOB = r"""
import io, os, sys, threading, time
import numpy as np, PIL.Image, ray
from aiomm.config import EngineConfig
from aiomm.integrations.ray import ImagePreprocessor

def actor_pids():
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if b"ImagePreprocessor" in f.read():
                        pids.add(int(d))
            except OSError:
                pass
    return pids

before = actor_pids()  # another job's leftovers are not this test's to judge
seen = set()
done = threading.Event()

def watch():
    while not done.is_set():
        seen.update(actor_pids() - before)
        time.sleep(0.05)

threading.Thread(target=watch, daemon=True).start()

def png(seed):
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), np.uint8)
    PIL.Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
prompt = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|><|im_end|>"
rows = [{"image": [png(i)], "prompt": prompt} for i in range(8)]
ds = ray.data.from_items(rows).map_batches(
    ImagePreprocessor,
    fn_constructor_kwargs={
        "model": "qwen2-vl", "config": EngineConfig(device="cpu", transform_threads=1)
    },
    compute=ray.data.ActorPoolStrategy(size=2),
    batch_size=2,
)
out = ds.take_all()
assert len(out) == 8 and all(r["error"] is None for r in out), [r["error"] for r in out]
seen.update(actor_pids() - before)
ray.shutdown()
done.set()
print("actors", len(seen), flush=True)
deadline = time.monotonic() + 30
alive = set(seen)
while alive and time.monotonic() < deadline:
    time.sleep(0.2)
    alive = {p for p in seen if os.path.exists(f"/proc/{p}")}
for pid in alive:  # not left behind for the next test, whatever this one finds
    os.kill(pid, 9)
print("alive after shutdown", len(alive), flush=True)
"""


@pytest.mark.timeout(400)
def test_no_image_preprocessor_actor_outlives_ray_shutdown() -> None:
    with tempfile.TemporaryDirectory() as empty:  # away from the checkout's kernels/
        proc = run_python(f"import os; os.chdir({empty!r})\n" + JOB, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = re.search(r"^actors (\d+)$", proc.stdout, re.M)
    assert seen and int(seen[1]) >= 2, proc.stdout  # the pool's actors were seen: the check bites
    assert "alive after shutdown 0" in proc.stdout, proc.stdout
