"""``aiomm serve`` as a process: it serves, and SIGTERM drains in-flight requests and stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from aiomm.cli import main
from aiomm.tuning.malloc import prefer_small_pages

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, free_port

FIXTURE = Path(__file__).parent / "fixtures" / "chat_two_images.json"


def test_serve_turns_numpy_huge_pages_off_here_and_in_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from numpy._core.multiarray import _set_madvise_hugepage

    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    before = _set_madvise_hugepage(True)
    try:
        prefer_small_pages()
        assert _set_madvise_hugepage(False) is False  # the call returns the state it replaces
    finally:
        _set_madvise_hugepage(before)
    # a worker process (uvicorn spawns them) imports numpy with the server's environment
    child = subprocess.run(
        [sys.executable, "-c", "from numpy._core.multiarray import _set_madvise_hugepage as s; "
         "print(s(True))"],
        env={**os.environ}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert child.stdout.strip() == "False"


def test_serve_refuses_a_missing_folder(tmp_path: Path, capsys: Any) -> None:
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--transform-threads", "--busy-transform-threads"])
def test_serve_refuses_zero_transform_threads(model_folder: Path, capsys: Any, flag: str) -> None:
    assert main(["serve", str(model_folder), flag, "0"]) == 2
    assert f"{flag} must be at least 1" in capsys.readouterr().out


def test_serve_passes_the_busy_transform_threads_on(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiomm.server import ServerConfig

    served: list[ServerConfig] = []
    monkeypatch.setattr(
        "aiomm.server.serve.serve", lambda config, **kwargs: served.append(config) or 0
    )
    assert main(["serve", str(model_folder), "--busy-transform-threads", "3"]) == 0
    assert main(["serve", str(model_folder)]) == 0
    assert [c.busy_transform_threads for c in served] == [3, None]


def test_serve_passes_the_pinning_on(model_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[bool] = []
    monkeypatch.setattr(
        "aiomm.server.serve.serve",
        lambda config, *, pin_workers, **kwargs: pinned.append(pin_workers) or 0,
    )
    assert main(["serve", str(model_folder), "--workers", "2", "--pin-workers"]) == 0
    assert main(["serve", str(model_folder), "--workers", "2"]) == 0
    assert pinned == [True, False]


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_serve_refuses_a_negative_cache_size(model_folder: Path, capsys: Any, value: str) -> None:
    assert main(["serve", str(model_folder), "--cache-gb", value]) == 2
    assert "--cache-gb must be 0 or more" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "pretouch"), [((), False), (("--cache-pretouch",), True)], ids=["default", "on"]
)
def test_serve_pretouches_the_cache_only_when_asked(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], pretouch: bool
) -> None:
    from aiomm.server import ServerConfig

    served: list[ServerConfig] = []
    monkeypatch.setattr(
        "aiomm.server.serve.serve", lambda config, **kwargs: served.append(config) or 0
    )
    assert main(["serve", str(model_folder), *flags]) == 0
    assert [c.cache_pretouch for c in served] == [pretouch]
    assert [c.tuned for c in served] == [True]  # the server owns its process
    assert ServerConfig(model="m").cache_pretouch is False  # an app mounted elsewhere: off
    assert ServerConfig(model="m").tuned is False


def test_serve_drops_the_pretouch_when_the_host_lacks_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiomm.config import available_cores
    from aiomm.server import ServerConfig
    from aiomm.server import serve as serve_module

    asked: list[int] = []
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(serve_module, "prefer_small_pages", lambda: None)
    monkeypatch.setattr(serve_module, "pretouch_fits", lambda n: asked.append(n) or False)
    options: list[dict[str, Any]] = []
    monkeypatch.setattr(
        serve_module,
        "run_workers",
        lambda host, port, workers, opts, pin=False: (
            options.append(opts)
            or started.append(json.loads(os.environ["AIOMM_SERVE_CONFIG"]))
            or 0
        ),
    )
    monkeypatch.delenv("AIOMM_SERVE_CONFIG", raising=False)
    config = ServerConfig(model="m", cache_bytes=3 << 30, cache_pretouch=True)
    assert serve_module.serve(config, host="127.0.0.1", port=1, workers=2, peer_cache=False) == 0
    assert asked == [3 << 30]  # the whole server's budget, checked once before the workers
    assert started[0]["cache_pretouch"] is False and started[0]["cache_bytes"] == 3 << 29
    assert started[0]["busy_transform_threads"] == max(1, available_cores() // 2)
    # no WebSocket upgrades (an upgraded connection would stay counted by the worker's balance)
    assert options[0]["ws"] == "none"


def test_workers_share_one_cache_budget() -> None:
    from aiomm.config import EngineConfig
    from aiomm.server import ServerConfig
    from aiomm.server.serve import worker_config

    default = EngineConfig.cache_capacity_bytes
    assert worker_config(ServerConfig(model="m"), 2).cache_bytes == default // 2
    assert worker_config(ServerConfig(model="m", cache_bytes=3 << 30), 3).cache_bytes == 1 << 30
    assert worker_config(ServerConfig(model="m", cache_bytes=0), 4).cache_bytes == 0
    # the items' base64 as each response is sent while a process has at most 2 cores to itself
    assert worker_config(ServerConfig(model="m"), 2, cores=2).encode_on_send is True
    assert worker_config(ServerConfig(model="m"), 1, cores=2).encode_on_send is True
    assert worker_config(ServerConfig(model="m"), 8, cores=16).encode_on_send is True
    assert worker_config(ServerConfig(model="m"), 1, cores=16).encode_on_send is False
    assert worker_config(ServerConfig(model="m"), 2, cores=6).encode_on_send is False
    explicit = ServerConfig(model="m", encode_on_send=False)
    assert worker_config(explicit, 2, cores=2).encode_on_send is False


def test_workers_share_the_cores_under_load() -> None:
    """Each of N workers runs cores / N transform threads while busy (at least one); one
    worker, or a value given, keeps the engine's rule."""
    from aiomm.config import available_cores
    from aiomm.server import ServerConfig
    from aiomm.server.serve import worker_config

    m = ServerConfig(model="m")
    assert worker_config(m, 2, cores=2).busy_transform_threads == 1
    assert worker_config(m, 4, cores=16).busy_transform_threads == 4
    assert worker_config(m, 3, cores=2).busy_transform_threads == 1
    assert worker_config(m, 1, cores=16).busy_transform_threads is None
    given = ServerConfig(model="m", busy_transform_threads=3)
    assert worker_config(given, 2, cores=2).busy_transform_threads == 3
    assert worker_config(m, 2).busy_transform_threads == max(1, available_cores() // 2)


def _start(model_folder: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """``aiomm serve`` for the fixtures' folder, once its /health answers."""
    port = free_port()
    exe = Path(sys.executable).with_name("aiomm")
    proc = subprocess.Popen(
        [str(exe), "serve", str(model_folder), "--port", str(port), "--model-id",
         RECORDED_MODEL, "--served-model-name", RECORDED_MODEL, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    _stop(proc)
    raise AssertionError("aiomm serve did not answer /health within 120 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _workers(proc: subprocess.Popen[bytes]) -> list[str]:
    """The pids of the supervisor's worker processes (spawned by multiprocessing)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return [c for c in children if "spawn_main" in _cmdline(c)]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # gone meanwhile
        return ""


def _tcp(port: int, state: str) -> set[str]:
    """Socket inodes of the TCP sockets in ``state`` (hex, as /proc/net shows it) whose local
    port is ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                found.add(fields[9])
    return found


def _established(port: int) -> set[str]:
    return _tcp(port, "01")


def _listening(port: int) -> set[str]:
    return _tcp(port, "0A")


def _socket_inodes(pid: str) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _peer_folder(pid: str) -> Path:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    text = next(e for e in env if e.startswith(b"AIOMM_SERVE_CONFIG="))
    return Path(json.loads(text.split(b"=", 1)[1])["peer_cache_dir"])


def test_serve_workers_start_and_render(model_folder: Path) -> None:
    proc, url = _start(model_folder, "--workers", "2", "--mm-processor-cache-gb", "1")
    try:
        workers = _workers(proc)
        assert len(workers) == 2
        # each worker listens on its own socket (once started): a burst of new connections
        # reaches both
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 120
        while len(_listening(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_listening(port) & _socket_inodes(pid) for pid in workers)
        # not pinned unless asked (--pin-workers): the kernel places their threads
        assert all(os.sched_getaffinity(int(pid)) == os.sched_getaffinity(0) for pid in workers)
        burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        try:
            for conn in burst:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            heads = [conn.recv(1024) for conn in burst]
            assert all(head.startswith(b"HTTP/1.1 200") for head in heads)
            # a worker two or more connections ahead closes its surplus after the response
            shed = sum(b"connection: close" in head.lower() for head in heads)
            time.sleep(0.5)
            served = _established(port)
            held = [len(_socket_inodes(pid) & served) for pid in workers]
        finally:
            for conn in burst:
                conn.close()
        assert sum(held) + shed == 16 and min(held) > 0, (held, shed)
        # the workers share items through a private folder, one socket each
        folder = _peer_folder(workers[0])
        assert folder.stat().st_mode & 0o777 == 0o700
        assert len([p for p in folder.iterdir() if p.name.endswith(".sock")]) == 2
        case = json.loads(FIXTURE.read_text())
        expected = case["response"]
        for _ in range(4):  # new connections: the kernel hands them to either worker
            r = httpx.post(url + case["path"], json=case["body"], timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["token_ids"] == expected["token_ids"]
            for key in ("mm_hashes", "mm_placeholders", "kwargs_data"):
                assert got["features"][key] == expected["features"][key], key
        assert any(p.name.startswith("i") for p in folder.iterdir())  # the image's link
        # one cache budget for the server: each worker may hold half of it (new connections
        # reach either worker; the one that computed the image holds it)
        # (enough scrapes, each a new connection, that the holding worker is surely among them)
        scraped = [httpx.get(url + "/metrics", timeout=10).text for _ in range(40)]
        capacity, held = (
            [float(text.split(f"\n{name} ")[1].split()[0]) for text in scraped]
            for name in ("aiomm_cache_capacity_bytes", "aiomm_cache_bytes")
        )
        assert set(capacity) == {2**29} and 0 < max(held) <= 2**29, held
        # the cache grows on demand (pretouching is --cache-pretouch's, tested on its own)
        pretouched = {
            float(text.split("\naiomm_cache_pretouched_bytes ")[1].split()[0]) for text in scraped
        }
        assert pretouched == {0}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)
        assert not folder.exists()
    finally:
        _stop(proc)


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


def test_serve_process_drains_on_sigterm(model_folder: Path) -> None:
    proc, url = _start(model_folder, "--cache-gb", "0.25")
    try:
        case = json.loads(FIXTURE.read_text())
        result: dict[str, Any] = {}
        raw = json.dumps(case["body"]).encode()
        first_sent, signalled = threading.Event(), threading.Event()

        def body() -> Any:
            # half the body, then the rest only after SIGTERM: the request is surely in flight
            yield raw[: len(raw) // 2]
            first_sent.set()
            signalled.wait(30)
            time.sleep(0.2)
            yield raw[len(raw) // 2 :]

        def post() -> None:
            try:
                result["r"] = httpx.post(
                    url + case["path"],
                    content=body(),
                    timeout=60,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError as exc:
                result["r"] = exc

        thread = threading.Thread(target=post)
        thread.start()
        assert first_sent.wait(30)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        signalled.set()
        thread.join(60)
        # uvicorn re-raises the captured signal once it has drained and shut down
        assert proc.wait(60) in (0, -signal.SIGTERM)
        r = result["r"]
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 200
        expected = case["response"]["features"]["mm_hashes"]
        assert r.json()["features"]["mm_hashes"] == expected
        log = proc.stdout.read().decode() if proc.stdout else ""
        lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
        assert any(x.get("event") == "request" and x.get("status") == 200 for x in lines), log
    finally:
        _stop(proc)


@pytest.mark.parametrize("group", [False, True], ids=["listener", "reuseport-group"])
def test_serve_workers_report_a_taken_port(model_folder: Path, group: bool) -> None:
    # a group: another server's SO_REUSEPORT socket, which the workers' sockets would join
    with socket.socket() as taken:
        if group:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        exe = Path(sys.executable).with_name("aiomm")
        done = subprocess.run(
            [str(exe), "serve", str(model_folder), "--port", str(port), "--workers", "2"],
            capture_output=True, text=True, timeout=120, env={**os.environ},
        )  # fmt: skip
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stdout


def test_serve_workers_that_fail_at_start_stop_the_server(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("aiomm")
    done = subprocess.run(
        [str(exe), "serve", str(tmp_path), "--port", str(free_port()), "--workers", "2"],
        capture_output=True, text=True, timeout=180, env={**os.environ},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    assert "worker_failed_at_start" in done.stdout + done.stderr


def test_serve_whose_app_fails_at_start_exits_with_uvicorns_status(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("aiomm")
    done = subprocess.run(
        [str(exe), "serve", str(tmp_path), "--port", str(free_port())],
        capture_output=True, text=True, timeout=180, env={**os.environ},
    )  # fmt: skip
    assert done.returncode == 3, done.stdout[-2000:]
    assert "Application startup failed" in done.stdout + done.stderr


def test_serve_restarts_a_worker_that_dies_while_serving(model_folder: Path) -> None:
    proc, url = _start(model_folder, "--workers", "2", "--cache-gb", "0.25")
    try:
        port = int(url.rsplit(":", 1)[1])

        def workers() -> list[str]:
            return [c for c in _workers(proc) if _state(c) != "Z"]

        deadline = time.monotonic() + 120
        while len(_listening(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        victim = workers()[0]
        os.kill(int(victim), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            alive = workers()
            if victim not in alive and len(alive) == 2 and len(_listening(port)) == 2:
                break
            time.sleep(0.2)
        assert victim not in alive and len(alive) == 2 and len(_listening(port)) == 2
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        _stop(proc)


def _thread_cores(pid: str) -> set[frozenset[int]]:
    """The distinct CPU affinities of ``pid``'s threads."""
    cores = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cores.add(frozenset(os.sched_getaffinity(int(task.name))))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return cores


def test_serve_pins_each_worker_to_its_share_of_the_cores(model_folder: Path) -> None:
    """With ``--pin-workers`` every thread of a worker runs on the worker's own share of the
    cores, a replacement worker on the share of the one it replaces, and the server renders."""
    from aiomm.server.runtime.pinning import worker_cpus

    proc, url = _start(model_folder, "--workers", "2", "--cache-gb", "0.25", "--pin-workers")
    try:
        shares = sorted(map(sorted, worker_cpus(os.sched_getaffinity(0), 2)))

        def pinned() -> dict[str, frozenset[int]]:
            # each live worker whose threads share one affinity (the host's, until it pins)
            live = [pid for pid in _workers(proc) if _state(pid) != "Z"]
            cores = {pid: _thread_cores(pid) for pid in live}
            return {pid: next(iter(c)) for pid, c in cores.items() if len(c) == 1}

        deadline = time.monotonic() + 120
        while sorted(map(sorted, pinned().values())) != shares and time.monotonic() < deadline:
            time.sleep(0.2)
        held = pinned()
        assert sorted(map(sorted, held.values())) == shares, held
        case = json.loads(FIXTURE.read_text())
        r = httpx.post(url + case["path"], json=case["body"], timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["features"]["mm_hashes"] == case["response"]["features"]["mm_hashes"]
        victim, cores = next(iter(held.items()))
        os.kill(int(victim), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = pinned()
            if victim not in now and sorted(map(sorted, now.values())) == shares:
                break
            time.sleep(0.2)
        replacement = [pid for pid in now if pid not in held]
        assert len(replacement) == 1 and now[replacement[0]] == cores, (held, now)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        _stop(proc)


def test_serve_workers_end_when_the_supervisor_is_killed(model_folder: Path) -> None:
    proc, _ = _start(model_folder, "--workers", "2", "--cache-gb", "0.25")
    try:
        workers = _workers(proc)
        assert len(workers) == 2
        proc.kill()  # no chance to stop them itself
        proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_state(pid) != "Z" for pid in workers):
            time.sleep(0.2)
        assert all(_state(pid) == "Z" for pid in workers)
    finally:
        _stop(proc)


def test_serve_workers_even_out_a_pools_connections(model_folder: Path) -> None:
    """Eight keep-alive connections end four on each worker, whatever the kernel's first
    split: a worker two ahead answers with ``Connection: close`` and the client reconnects."""
    proc, url = _start(model_folder, "--workers", "2", "--cache-gb", "0.25")
    clients = [httpx.Client(base_url=url, timeout=30) for _ in range(8)]
    try:
        workers = _workers(proc)
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 120
        while len(_listening(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        held: list[int] = []
        closed = 0
        for _ in range(30):
            for client in clients:
                r = client.get("/health")
                assert r.status_code == 200
                closed += r.headers.get("connection") == "close"
            served = _established(port)
            held = sorted(len(_socket_inodes(pid) & served) for pid in workers)
            if held == [4, 4]:
                break
        assert held == [4, 4], (held, closed)
    finally:
        for client in clients:
            client.close()
        _stop(proc)


def test_serve_answers_health_within_seconds_in_little_memory_on_its_defaults(
    tmp_path: Path,
) -> None:
    """``aiomm serve qwen2-vl`` on its defaults: the cache grows on demand (no pretouch), so the
    server starts in seconds and holds little memory (it used to take 17 s and ~5 GB)."""
    env = {**os.environ, "AIOMM_CACHE_DIR": str(tmp_path / "cache")}
    build = "from aiomm.adapters.folders import model_folder; model_folder('qwen2-vl')"
    subprocess.run([sys.executable, "-P", "-c", build], env=env, check=True)  # a cold folder
    port = free_port()
    exe = Path(sys.executable).with_name("aiomm")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(exe), "serve", "qwen2-vl", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        while time.monotonic() - t0 < 60 and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        started = time.monotonic() - t0
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss_kib = int(
            next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]
        )
    finally:
        _stop(proc)
    assert started < 10, f"/health after {started:.1f} s"
    assert rss_kib < 1.5 * 2**20, f"{rss_kib >> 10} MiB resident"
