"""``aiomm.tuning.malloc.tune_malloc``: applied once on glibc, skipped when the operator set
malloc."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
from fresh_python import run_python

from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.tuning import malloc as memory


def last_line(code: str, env: dict[str, str] | None = None) -> str:
    """What ``code`` printed last (after any log lines), run without our malloc settings."""
    out = run_python(code, unset=("GLIBC_TUNABLES",), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_applied_once_per_process_on_glibc() -> None:
    code = (
        "from aiomm.tuning.malloc import tune_malloc; "
        "print(tune_malloc(), tune_malloc(mmap_threshold=1))"
    )
    assert last_line(code) == "True True"


def test_operator_tunables_win() -> None:
    code = "from aiomm.tuning.malloc import tune_malloc; print(tune_malloc())"
    env = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}
    assert last_line(code, env=env) == "False"


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
@pytest.mark.parametrize("in_thread", [False, True], ids=["main", "worker-thread"])
def test_freed_image_buffers_are_reused_not_mapped_again(in_thread: bool) -> None:
    """Buffers of 4-8 MiB, six at a time, as images of mixed sizes need: once tuned, later rounds
    reuse the heap (glibc's defaults return the memory and fault it in again: ~30% of pages)."""
    code = f"""
import resource, threading, numpy as np
from aiomm.tuning.malloc import tune_malloc
assert tune_malloc()
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def work():
    pages = 0
    before = faults()
    for i in range(20):
        bufs = [np.ones((4 + (i + k) % 5) << 20, np.uint8) for k in range(6)]
        pages += sum(b.nbytes for b in bufs) // 4096
        del bufs
    print((faults() - before) / pages)
if {in_thread}:
    t = threading.Thread(target=work); t.start(); t.join()
else:
    work()
"""
    assert float(last_line(code)) < 0.1


async def test_engine_applies_it_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, make_processor
) -> None:
    calls: list[int] = []
    monkeypatch.setattr("aiomm.engine._engine.tune_malloc", lambda: calls.append(1) or True)
    async with Engine(make_processor(), EngineConfig(device="cpu")):
        pass
    assert calls == []  # a library leaves its host's malloc alone by default
    async with Engine(make_processor(), EngineConfig(device="cpu", tune_malloc=True)):
        pass
    assert calls == [1]
    assert memory.DEFAULT_MMAP_THRESHOLD == 32 << 20


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize("pretouch", [True, False], ids=["pretouched", "not-pretouched"])
def test_pretouched_heap_serves_a_growing_cache_without_new_memory(pretouch: bool) -> None:
    """A cache that only grows (items of 1-5 MiB kept, from two threads) takes the memory
    :func:`pretouch_heap` faulted in: the process's resident memory does not grow with it
    (resident memory, not fault counts: huge pages fault 2 MiB at a time)."""
    code = f"""
import threading, numpy as np
from aiomm.tuning import malloc as memory
assert memory.tune_malloc() and memory.use_one_arena()
touched = memory.pretouch_heap(96 << 20) if {pretouch} else 0
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
kept, nbytes = [], [0]
def grow(seed):
    for i in range(8):
        item = np.ones((1 + (seed + i) % 5) << 20, np.uint8)
        kept.append(item)
        nbytes[0] += item.nbytes
before = rss()
threads = [threading.Thread(target=grow, args=(k,)) for k in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print(touched, (rss() - before) / nbytes[0])
"""
    touched, growth = last_line(code).split()
    if pretouch:
        assert int(touched) >= 96 << 20
        assert float(growth) < 0.05
    else:
        assert float(growth) > 0.5


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_pretouched_memory_is_returned_when_the_last_engine_closes() -> None:
    code = """
from aiomm.tuning import malloc as memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
memory.engine_opened()
assert memory.tune_malloc()
memory.undo_on_last_close("malloc", memory.untune_malloc)  # as the engine does
base = rss()
touched = memory.pretouch_heap(128 << 20)
held = rss() - base
memory.release_after_last_engine()
print(touched, held >> 20, (rss() - base) >> 20)
"""
    touched, held_mib, after_mib = (int(v) for v in last_line(code).split())
    assert touched >= 128 << 20
    assert held_mib >= 128  # faulted in and kept while an engine is open
    assert after_mib < 16  # the fence freed, the heap trimmed


def test_room_counts_the_control_groups_limit(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "svc").mkdir(parents=True)
    (v2 / "svc" / "memory.max").write_text("1073741824\n")
    (v2 / "svc" / "memory.current").write_text("268435456\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/svc\n")
    assert memory._cgroup_headroom(str(v2), str(cgroup)) == 768 << 20
    (v2 / "svc" / "memory.max").write_text("max\n")
    assert memory._cgroup_headroom(str(v2), str(cgroup)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory" / "job" / "memory.usage_in_bytes").write_text(str(1 << 30))
    cgroup.write_text("5:cpu:/\n4:memory:/job\n")
    assert memory._cgroup_headroom(str(v1), str(cgroup)) == 1 << 30


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_pretouch_needs_the_malloc_settings_and_room_on_the_host() -> None:
    code = "from aiomm.tuning import malloc as memory; print(memory.pretouch_heap(1 << 20))"
    assert last_line(code) == "0"  # malloc not tuned: the blocks would be mappings
    code = (
        "from aiomm.tuning import malloc as memory; memory.tune_malloc(); "
        "print(memory.pretouch_heap(1 << 50), memory.pretouch_heap(1 << 20) >= 1 << 20)"
    )
    # a petabyte is refused (a warning), nothing touched; a megabyte is touched
    assert last_line(code) == "0 True"


def test_pretouch_leaves_operator_tunables_alone() -> None:
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    code = (
        "from aiomm.tuning import malloc as memory; "
        "print(memory.tune_malloc(), memory.use_one_arena(), memory.pretouch_heap(1 << 20))"
    )
    assert last_line(code, env=env) == "False False 0"
