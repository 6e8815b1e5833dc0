"""Render-tier benchmark: ``aiomm serve`` against ``vllm launch render``, same load, one run.

Both servers run side by side (idle, neither costs CPU) and each level is measured in
interleaved rounds (aiomm, vLLM, then vLLM, aiomm), because this machine is shared and its other
load changes by the minute. A seeded closed-loop HTTP load (``--n`` requests per level and round,
each worker sending its next request when the previous one is answered) posts chat bodies with
1-2 images as ``data:`` URLs (JPEG q90, a mix of sizes, about ``--repeat-frac`` of the image slots
repeating an earlier image) to ``/v1/chat/completions/render`` at each ``--concurrency`` level.
Every body is built before the clock starts; the client reads each response whole. Reported per
server and level: images/s, latency p50/p99, the server's CPU ms per image and cores busy
(utime+stime of the server process and its children from /proc, over the measured window), the
load generator's cores and the machine's idle cores over the same window (the three share the
machine: what the server did not get, the generator or other jobs took, or nobody), then
aiomm/vLLM ratios.

    python bench/render_bench.py [--vllm-venv /tmp/vllm-venv] [--n 60] [--concurrency 8 32]

``--warm N`` first sends each server N requests of a plan of their own (other images, the same
mix), at the highest concurrency: the item caches fill and the processes' memory settles, so
the rounds measure the servers' steady state instead of their caches' growth (reported as
``warm`` rows).

``--compare-flags=FLAGS`` also runs ``aiomm-b``, a second aiomm server with FLAGS appended, in
the same rounds, and prints aiomm/aiomm-b ratios (one change measured side by side). Without
``--vllm-venv`` only aiomm is measured. Both servers get the same model folder path
(``--model-folder``; built offline when missing), so their mm_hashes agree.

``--plans`` measures routing plans (``mm_payload: "none"``: token ids, mm_hashes and
placeholders from the images' headers, no pixels decoded) against full tensors, on one aiomm
server with its item cache off (``--cache-gb 0``: it keeps no items and no plans, so nothing is
answered from a cache) and, with ``--vllm-venv``, vLLM's render server with its processor cache
off (``--mm-processor-cache-gb 0``). Three systems run in the same interleaved rounds, on the
same request bodies, every image distinct (``--repeat-frac 0``; ``--mm-payload`` is ignored):
``aiomm-tensors`` (``mm_payload: "tensors"``) and ``aiomm-none`` (``"none"``), both on the same
aiomm server process, and ``vllm-none`` (``"none"``). One system runs at a time, so each one's
server CPU per image counts only its own rounds. Printed per level, besides the table: aiomm's
CPU per image, tensors/none; images/s, aiomm-none/vllm-none; and CPU per image,
vllm-none/aiomm-none (all three in ``--json`` too, under ``ratios``; they divide the CPU seconds
measured, not the table's rounded CPU ms/img):

    python bench/render_bench.py --plans --vllm-venv /tmp/vllm-venv --n 150 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import io
import json
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import PIL.Image

REPO = Path(__file__).resolve().parents[1]
#: recv flag that drops TCP data in the kernel (Linux); elsewhere the bytes are copied
_DROP = getattr(socket, "MSG_TRUNC", 0) if sys.platform == "linux" else 0
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: the load generator waits for this much of a body before it wakes (``SO_RCVLOWAT``; 1: off)
_WAKE_BYTES = 1 << 20
#: the most one read of a response head takes (the body's first bytes come with it)
_HEAD_BYTES = 1 << 14
#: where a body's bytes are received to be dropped: one buffer for every connection, as the
#: kernel writes nothing into it (``MSG_TRUNC``; elsewhere its bytes are never read); its size
#: is the most one read drops
_SINK = memoryview(bytearray(1 << 22))


@dataclass
class LevelResult:
    server: str
    concurrency: int
    requests: int
    images: int
    wall_s: float
    images_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms_per_image: float
    server_cores_busy: float
    mb_received: float
    client_cpu_s: float
    #: seconds the whole machine's cores were idle (``/proc/stat`` idle + iowait)
    machine_idle_s: float = 0.0
    #: the server's CPU seconds over the window (what ``server_cpu_ms_per_image`` rounds)
    server_cpu_s: float = 0.0

    @property
    def cpu_ms_per_image(self) -> float:
        """The server's CPU ms per image, unrounded where its CPU seconds are known."""
        if self.server_cpu_s and self.images:
            return self.server_cpu_s * 1000 / self.images
        return self.server_cpu_ms_per_image

    @property
    def client_cores(self) -> float:
        """The load generator's CPU seconds per wall second."""
        return round(self.client_cpu_s / self.wall_s, 2) if self.wall_s else 0.0

    @property
    def machine_idle_cores(self) -> float:
        """Cores the whole machine left idle, on average."""
        return round(self.machine_idle_s / self.wall_s, 2) if self.wall_s else 0.0


def _row(result: LevelResult) -> dict[str, Any]:
    """``result`` as JSON: its fields and the cores derived from them."""
    cores = {"client_cores": result.client_cores, "machine_idle_cores": result.machine_idle_cores}
    return {**asdict(result), **cores}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """utime+stime of ``pid`` and its waited-for children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    total = (utime + stime + cutime + cstime) / CLK_TCK
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            total += _cpu_s(int(child))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _image(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6.28, 3)
    base = np.stack(
        [127 + 100 * np.sin(x / (30 + 20 * k) + y / (45 + 10 * k) + phase[k]) for k in range(3)],
        axis=-1,
    )
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _image_url(width: int, height: int, seed: int) -> str:
    """:func:`_image` as a ``data:`` URL."""
    return "data:image/jpeg;base64," + base64.b64encode(_image(width, height, seed)).decode()


def build_bodies(
    args: argparse.Namespace, seed: int, pool: Executor | None = None
) -> tuple[list[bytes], int]:
    """``args.n`` serialised request bodies and their image count (seeded). ``pool`` makes the
    images in parallel, to the same bodies: they are most of a run's time outside the clocks."""
    rng = np.random.default_rng(seed)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    # every draw first, in one order (the plan), then the images, which draw from their own seeds
    made: list[tuple[int, int, int]] = []  # width, height and seed of each image
    plan: list[list[int]] = []  # each request's images, as indexes into made
    for _ in range(args.n):
        slots = []
        for _ in range(2 if rng.random() < args.two_image_frac else 1):
            if made and rng.random() < args.repeat_frac:
                slots.append(int(rng.integers(len(made))))
            else:
                w, h = sizes[int(rng.integers(len(sizes)))]
                made.append((w, h, int(rng.integers(1 << 31))))
                slots.append(len(made) - 1)
        plan.append(slots)
    if pool is None or not made:
        urls = [_image_url(*image) for image in made]
    else:
        urls = list(pool.map(_image_url, *zip(*made, strict=True), chunksize=8))
    bodies: list[bytes] = []
    for slots in plan:
        content: list[dict[str, Any]] = [{"type": "text", "text": "Describe the image(s)."}]
        content += [{"type": "image_url", "image_url": {"url": urls[i]}} for i in slots]
        body = {
            "model": args.model_folder,
            "messages": [{"role": "user", "content": content}],
            "mm_payload": args.mm_payload,
        }
        bodies.append(json.dumps(body).encode())
    return bodies, sum(map(len, plan))


class _Connection:
    """A minimal keep-alive HTTP/1.1 client on a raw socket: the load generator shares the
    machine with the servers, so it receives each response's head into a small reused buffer,
    drops its body in the kernel keeping only its length (:meth:`_discard`), and wakes once per
    megabyte of a body, not once per burst (:meth:`_wake_at`)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sock: socket.socket | None = None
        # a head and the first of its body; it grows for a larger head. Bodies never come
        # here (_discard), and 32 connections' zeroed megabytes would be made on the clock
        self.buf = bytearray(4 * _HEAD_BYTES)
        self.view = memoryview(self.buf)
        self.have = 0  # bytes of the next response already received
        self.lowat = 1  # the socket's SO_RCVLOWAT (_wake_at)
        self.wake_max = _WAKE_BYTES  # at most half the receive buffer: it must fit

    async def _recv(self) -> int:
        loop = asyncio.get_running_loop()
        if self.have == len(self.buf):
            self.view.release()  # a bytearray with an exported view cannot grow
            self.buf.extend(bytes(len(self.buf)))
            self.view = memoryview(self.buf)
        self._wake_at(1)  # a head's size is unknown
        # a head's worth at most: the body behind it is dropped in the kernel (_discard), not
        # copied here and then moved to the buffer's start
        n = await loop.sock_recv_into(self.sock, self.view[self.have : self.have + _HEAD_BYTES])
        if not n:
            raise ConnectionError("the server closed the connection")
        self.have += n
        return n

    async def _discard(self, size: int) -> None:
        """Receive the rest of a ``size``-byte body (only its bytes: one request in flight).

        The bytes are acknowledged and dropped in the kernel (``MSG_TRUNC`` on a TCP socket,
        Linux) where it can, so the client spends no copy on the megabytes it only counts."""
        if self.have >= size:
            self.buf[: self.have - size] = self.buf[size : self.have]
            self.have -= size
            return
        left, self.have = size - self.have, 0
        while left:
            left -= await self._recv_dropped(min(len(_SINK), left))

    async def _recv_dropped(self, limit: int) -> int:
        loop = asyncio.get_running_loop()
        while True:
            try:
                n = self.sock.recv_into(_SINK, limit, _DROP)
            except BlockingIOError:
                self._wake_at(limit)
                ready = loop.create_future()
                loop.add_reader(self.sock.fileno(), ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_reader(self.sock.fileno())
                continue
            if not n:
                raise ConnectionError("the server closed the connection")
            return n

    def _wake_at(self, size: int) -> None:
        """Be woken only once ``size`` bytes (at most ``_WAKE_BYTES``, and at most half the
        socket's receive buffer) can be read.

        A response of megabytes arrives in many small bursts; waking for each one costs the
        generator a context switch and preempts whatever server thread shares its core.
        """
        lowat = max(1, min(size, self.wake_max))
        if lowat != self.lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self.lowat = lowat

    async def post(self, path: str, body: bytes) -> tuple[int, int, bytes]:
        """Status, body length and the body's first bytes (for error messages)."""
        return await self.exchange(request_bytes(self.host, path, body))

    async def exchange(self, request: bytes) -> tuple[int, int, bytes]:
        """Send one whole HTTP ``request`` (:func:`request_bytes`); as :meth:`post` returns."""
        loop = asyncio.get_running_loop()
        if self.sock is None:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            # the kernel caps the buffer (net.core.rmem_max) and reports twice what it keeps
            rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            self.wake_max = max(1, min(_WAKE_BYTES, rcvbuf // 4))
            self.sock.setblocking(False)
            await loop.sock_connect(self.sock, (self.host, self.port))
        await loop.sock_sendall(self.sock, request)
        while (end := self.buf.find(b"\r\n\r\n", 0, self.have)) < 0:
            await self._recv()
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        self.buf[: self.have - end - 4] = self.buf[end + 4 : self.have]
        self.have -= end + 4
        status = int(lines[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if "content-length" not in fields:
            raise RuntimeError(f"{status}: a response without Content-Length")
        size = int(fields["content-length"])
        while self.have < min(size, 300):
            await self._recv()
        first = bytes(self.buf[: min(self.have, size, 300)])
        await self._discard(size)
        if "close" in fields.get("connection", "").lower():
            self.close()  # as HTTP clients do: the next request opens a new connection
        return status, size, first

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.have, self.lowat = 0, 1


def _run(coro: Any) -> Any:
    """Run the load on uvloop when it is installed (less client CPU per response)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def request_bytes(host: str, path: str, body: bytes) -> bytes:
    """One keep-alive HTTP/1.1 POST of the JSON ``body`` to ``path``, head and body in one."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def requests_for(url: str, bodies: list[bytes]) -> list[bytes]:
    """``bodies`` as whole requests to ``url``: made before a level's clock starts, so the
    generator does not copy each body behind its head while it measures."""
    parsed = httpx.URL(url)
    return [request_bytes(parsed.host, parsed.raw_path.decode(), b) for b in bodies]


async def _drive(url: str, requests: list[bytes], concurrency: int) -> tuple[list[float], int]:
    """Send ``requests`` (:func:`requests_for` ``url``) over ``concurrency`` connections, each
    sending its next when the last is answered; the latencies and the bytes of the bodies."""
    parsed = httpx.URL(url)
    latencies: list[float] = []
    received = 0
    queue = list(reversed(requests))

    async def worker() -> None:
        nonlocal received
        conn = _Connection(parsed.host, parsed.port or 80)
        try:
            while queue:
                request = queue.pop()
                t = time.perf_counter()
                status, size, first = await conn.exchange(request)
                latencies.append(time.perf_counter() - t)
                if status != 200:
                    raise RuntimeError(f"{status}: {first!r}")
                received += size
        finally:
            conn.close()

    # the generator's garbage is a few futures per request; a collection pass would scan the
    # whole heap of a process that shares its machine with the server it measures
    collecting = gc.isenabled()
    gc.disable()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        if collecting:
            gc.enable()
    return latencies, received


def _idle_s(stat: str | None = None) -> float:
    """Seconds all of the machine's cores have been idle: idle + iowait of ``/proc/stat``'s
    ``cpu`` line (``stat``: that file's text; None reads it)."""
    text = Path("/proc/stat").read_text() if stat is None else stat
    fields = text.split("\n", 1)[0].split()  # cpu user nice system idle iowait irq ...
    return (int(fields[4]) + int(fields[5])) / CLK_TCK


def _level(
    name: str, url: str, pid: int, c: int, bodies: list[bytes], images: int, phase: str = "round"
) -> LevelResult:
    """One closed-loop run of ``bodies`` against one server; its JSON line names its ``phase``
    (``"warm"`` for the ``--warm`` requests, else ``"round"``)."""
    requests = requests_for(url, bodies)
    cpu0, idle0, t0, me0 = _cpu_s(pid), _idle_s(), time.perf_counter(), time.process_time()
    latencies, received = _run(_drive(url, requests, c))
    wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    client_cpu, idle = time.process_time() - me0, _idle_s() - idle0
    lat = np.array(latencies) * 1000
    result = LevelResult(
        name,
        c,
        len(bodies),
        images,
        round(wall, 2),
        round(images / wall, 2),
        round(float(np.percentile(lat, 50)), 1),
        round(float(np.percentile(lat, 99)), 1),
        round(cpu * 1000 / images, 1),
        round(cpu / wall, 2),
        round(received / 2**20, 1),
        round(client_cpu, 2),
        round(idle, 2),
        round(cpu, 3),
    )
    print(json.dumps({"phase": phase, **_row(result)}), flush=True)
    return result


#: the seed of the ``--warm`` plan is this far from ``--seed`` (the rounds' plans are within
#: ``1000 * levels``): its images come from other draws, so a measured round's image is one of
#: the warm-up's only by a 1-in-2**31 coincidence of two seeds
WARM_SEED_OFFSET = 10**6


def warm_plan(args: argparse.Namespace, pool: Executor | None = None) -> tuple[list[bytes], int]:
    """The ``--warm`` requests (and their image count): the rounds' mix, other images
    (``pool``: as :func:`build_bodies`)."""
    return build_bodies(
        argparse.Namespace(**{**vars(args), "n": args.warm}), args.seed + WARM_SEED_OFFSET, pool
    )


def with_payload(bodies: list[bytes], payload: str) -> list[bytes]:
    """``bodies`` (:func:`build_bodies`) asking for ``payload`` as their ``mm_payload``: the same
    images and text, byte for byte the bodies :func:`build_bodies` makes with that payload."""
    return [json.dumps({**json.loads(b), "mm_payload": payload}).encode() for b in bodies]


class _Payloads:
    """Each system's bodies of one plan: ``payloads`` names the ``mm_payload`` each system's
    requests ask for (None, or a system it does not name: the plan's own, ``args.mm_payload``);
    each other payload's bodies are made once per plan, before any clock starts."""

    def __init__(
        self, bodies: list[bytes], own: str, payloads: dict[str, str] | None = None
    ) -> None:
        self.made = {own: bodies}
        self.own, self.payloads = own, payloads or {}

    def __call__(self, name: str) -> list[bytes]:
        payload = self.payloads.get(name, self.own)
        if payload not in self.made:
            self.made[payload] = with_payload(self.made[self.own], payload)
        return self.made[payload]


def warm(
    servers: dict[str, tuple[str, int]],
    args: argparse.Namespace,
    pool: Executor | None = None,
    payloads: dict[str, str] | None = None,
) -> list[LevelResult]:
    """Each server answers the ``--warm`` plan at the highest concurrency (nothing when 0;
    ``pool``: as :func:`build_bodies`; ``payloads``: as :func:`measure`)."""
    if not args.warm:
        return []
    bodies, images = warm_plan(args, pool)
    of = _Payloads(bodies, args.mm_payload, payloads)
    c = max(args.concurrency)
    return [
        _level(name, url, pid, c, of(name), images, "warm") for name, (url, pid) in servers.items()
    ]


def measure(
    servers: dict[str, tuple[str, int]],
    args: argparse.Namespace,
    pool: Executor | None = None,
    payloads: dict[str, str] | None = None,
) -> list[LevelResult]:
    """Every level on every server, interleaved: round r runs the servers in order, then in
    reverse (ABBA), so a change in the machine's other load hits both alike. Each level and
    round has its own seeded plan, the same for every server (no hits across levels), built
    between the rounds (``pool``: as :func:`build_bodies`). ``payloads``: the ``mm_payload`` of
    each server's requests, where it is not ``args.mm_payload`` (two names may share one
    server's URL and process: one runs at a time, so each one's CPU is its own)."""
    first, _ = build_bodies(argparse.Namespace(**{**vars(args), "n": 2, "sizes": "320x240"}), 999)
    of = _Payloads(first, args.mm_payload, payloads)
    for name, (url, _pid) in servers.items():
        _run(_drive(url, requests_for(url, of(name)), 1))
    out = []
    names = list(servers)
    for level, c in enumerate(args.concurrency):
        for r in range(args.rounds):
            bodies, images = build_bodies(args, args.seed + 1000 * level + r, pool)
            of = _Payloads(bodies, args.mm_payload, payloads)
            for name in names if r % 2 == 0 else reversed(names):
                url, pid = servers[name]
                out.append(_level(name, url, pid, c, of(name), images))
    return out


def _combine(results: list[LevelResult]) -> list[LevelResult]:
    """One row per server and level: totals over its rounds (percentiles: the worst round's)."""
    rows: dict[tuple[str, int], list[LevelResult]] = {}
    for r in results:
        rows.setdefault((r.server, r.concurrency), []).append(r)
    out = []
    for (server, c), rs in rows.items():
        wall = sum(r.wall_s for r in rs)
        images = sum(r.images for r in rs)
        cpu_s = sum(r.cpu_ms_per_image * r.images for r in rs) / 1000
        out.append(
            LevelResult(
                server,
                c,
                sum(r.requests for r in rs),
                images,
                round(wall, 2),
                round(images / wall, 2),
                max(r.p50_ms for r in rs),
                max(r.p99_ms for r in rs),
                round(cpu_s * 1000 / images, 1),
                round(cpu_s / wall, 2),
                round(sum(r.mb_received for r in rs), 1),
                round(sum(r.client_cpu_s for r in rs), 2),
                round(sum(r.machine_idle_s for r in rs), 2),
                round(cpu_s, 3),
            )
        )
    return out


#: ``--plans``: each system measured, as the server it runs on and its requests' ``mm_payload``
PLAN_SYSTEMS = {
    "aiomm-tensors": ("aiomm", "tensors"),
    "aiomm-none": ("aiomm", "none"),
    "vllm-none": ("vllm", "none"),
}


def _ratio(a: float, b: float) -> float | None:
    """``a / b`` to 3 digits; None where ``b`` is 0 (under a clock tick of CPU, say)."""
    return round(a / b, 3) if b else None


def plan_ratios(results: list[LevelResult]) -> list[dict[str, Any]]:
    """The ``--plans`` ratios of each concurrency level (:func:`_combine`'s rows): aiomm's CPU
    per image, tensors/none; images/s, aiomm-none/vllm-none; and CPU per image,
    vllm-none/aiomm-none. A ratio whose systems were not both measured is left out; one that
    would divide by 0 is None."""
    by = {(r.server, r.concurrency): r for r in results}
    out = []
    for c in dict.fromkeys(r.concurrency for r in results):
        tensors, none, vllm = (by.get((s, c)) for s in PLAN_SYSTEMS)
        row: dict[str, Any] = {"concurrency": c}
        if tensors and none:
            row["cpu_per_image_tensors_over_none"] = _ratio(
                tensors.cpu_ms_per_image, none.cpu_ms_per_image
            )
        if none and vllm:
            row["images_per_s_aiomm_none_over_vllm_none"] = _ratio(
                none.images_per_s, vllm.images_per_s
            )
            row["cpu_per_image_vllm_none_over_aiomm_none"] = _ratio(
                vllm.cpu_ms_per_image, none.cpu_ms_per_image
            )
        out.append(row)
    return out


def _times(ratio: float | None) -> str:
    return "n/a (no CPU measured)" if ratio is None else f"x{ratio:.2f}"


def plan_ratio_lines(ratios: list[dict[str, Any]]) -> list[str]:
    """:func:`plan_ratios` as the lines the benchmark prints."""
    labels = {
        "cpu_per_image_tensors_over_none": "aiomm CPU per image, tensors/none",
        "images_per_s_aiomm_none_over_vllm_none": "images/s, aiomm-none/vllm-none",
        "cpu_per_image_vllm_none_over_aiomm_none": "CPU per image, vllm-none/aiomm-none",
    }
    return [
        f"c={row['concurrency']}: {label} {_times(row[key])}"
        for row in ratios
        for key, label in labels.items()
        if key in row
    ]


def listening_sockets(port: int) -> int | None:
    """TCP sockets listening on ``port`` (Linux ``/proc/net``; elsewhere None: unknown)."""
    count, tables = 0, [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return None
    for table in tables:
        if table.exists():
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                count += int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A"
    return count


class Server:
    """A server subprocess on a free loopback port, stopped with SIGTERM."""

    def __init__(
        self, cmd: list[str], env: dict[str, str], port: int, log: Path, listeners: int = 1
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.listeners = listeners  # worker processes: each listens on the port itself
        self.log = log.open("wb")
        # started outside the checkout: a child's ``python -m`` puts its working directory on
        # sys.path, where the checkout's kernels/ folder would shadow Hugging Face's package
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=log.parent
        )

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                healthy = httpx.get(self.url + "/health", timeout=1).status_code == 200
                listening = listening_sockets(self.port)
                if healthy and (listening is None or listening >= self.listeners):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def aiomm_command(
    args: argparse.Namespace, port: int, flags: list[str], *, from_path: bool = False
) -> list[str]:
    """``aiomm serve`` of the benchmark's folder on ``port``, with ``flags`` appended;
    ``from_path``: the aiomm that ``PYTHONPATH`` finds first (another build's)."""
    entry = [str(Path(sys.executable).with_name("aiomm"))]
    if from_path:
        entry = [sys.executable, "-c", "import sys; from aiomm.cli import main; sys.exit(main())"]
    cmd = [
        *entry,
        "serve",
        str(args.model_folder),
        "--port",
        str(port),
        "--workers",
        str(args.workers),
    ]
    if args.cache_gb is not None:
        cmd += ["--cache-gb", str(args.cache_gb)]
    return cmd + flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-folder", default="/tmp/vllm-probe/qwen2vl")
    parser.add_argument("--vllm-venv", help="a venv with vllm 0.33 (vllm launch render)")
    parser.add_argument("--n", type=int, default=60, help="requests per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sizes", default="640x480,1280x720,333x777,1920x1080")
    parser.add_argument("--two-image-frac", type=float, default=0.5)
    parser.add_argument("--repeat-frac", type=float, default=0.25)
    parser.add_argument("--mm-payload", choices=["tensors", "none"], default="tensors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per level")
    parser.add_argument(
        "--warm",
        type=int,
        default=0,
        help="requests each server answers before the rounds (own images): caches full, "
        "steady state measured",
    )
    parser.add_argument("--workers", type=int, default=1, help="aiomm serve --workers")
    parser.add_argument(
        "--cache-gb", type=float, help="aiomm serve --cache-gb (default: aiomm's default)"
    )
    parser.add_argument(
        "--aiomm-flags",
        default="",
        help="extra flags of the aiomm server (with '=': --aiomm-flags=--pin-workers)",
    )
    parser.add_argument(
        "--compare-flags",
        help="also run 'aiomm-b', an aiomm server with these extra flags, in the same rounds "
        "(with '=': --compare-flags=--no-cache-pretouch)",
    )
    parser.add_argument(
        "--compare-build",
        type=Path,
        help="run 'aiomm-b' from another build of aiomm in the same rounds: a folder holding "
        "its installed package (pip install --no-deps --target DIR CHECKOUT); with "
        "--compare-flags, those are its flags, else the same as aiomm's",
    )
    parser.add_argument(
        "--plans",
        action="store_true",
        help="routing plans against tensors: aiomm-tensors, aiomm-none (one aiomm server, "
        "item cache off) and, with --vllm-venv, vllm-none (processor cache off), on the same "
        "distinct images (--repeat-frac 0; --mm-payload ignored)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.warm < 0:
        parser.error(f"--warm must be 0 or more, got {args.warm}")
    if args.plans:
        if args.compare_flags is not None or args.compare_build is not None:
            parser.error("--plans runs one aiomm server: no --compare-flags or --compare-build")
        if args.cache_gb not in (None, 0):
            parser.error(f"--plans runs aiomm with its cache off, not --cache-gb {args.cache_gb}")
        # every image distinct, no item (or plan) cached: each request is computed whole
        args.cache_gb, args.repeat_frac, args.mm_payload = 0, 0.0, "tensors"

    # the servers start in the logs folder: a relative path would resolve there
    folder = Path(args.model_folder).resolve()
    args.model_folder = str(folder)
    if args.vllm_venv:
        args.vllm_venv = str(Path(args.vllm_venv).resolve())
    if not (folder / "tokenizer.json").is_file():
        sys.path.insert(0, str(REPO / "tests" / "support"))
        from qwen2vl_folder import build_folder

        build_folder(folder)
    logs = Path("/tmp/aiomm-render-bench")
    logs.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "",
    }
    with contextlib.ExitStack() as stack:
        servers = {}
        variants = {"aiomm": shlex.split(args.aiomm_flags)}
        if args.compare_flags is not None or args.compare_build is not None:
            variants["aiomm-b"] = shlex.split(
                args.aiomm_flags if args.compare_flags is None else args.compare_flags
            )
        for name, flags in variants.items():
            port = _free_port()
            other_build = name == "aiomm-b" and args.compare_build is not None
            cmd = aiomm_command(args, port, flags, from_path=other_build)
            server_env = env
            if other_build:
                server_env = {**env, "PYTHONPATH": str(args.compare_build.resolve())}
            print(f"{name}: {shlex.join(cmd[1:])}", flush=True)
            started = stack.enter_context(
                Server(cmd, server_env, port, logs / f"{name}.log", args.workers)
            )
            servers[name] = (started.url + "/v1/chat/completions/render", started.proc.pid)
        if args.vllm_venv:
            port = _free_port()
            vllm = [
                f"{args.vllm_venv}/bin/vllm",
                "launch",
                "render",
                str(folder),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--limit-mm-per-prompt",
                '{"video": 0}',
                "--disable-uvicorn-access-log",
            ]
            if args.plans:
                vllm += ["--mm-processor-cache-gb", "0"]
            venv_env = {
                **env,
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
            started = stack.enter_context(Server(vllm, venv_env, port, logs / "vllm.log"))
            servers["vllm"] = (started.url + "/v1/chat/completions/render", started.proc.pid)
        # the plans' images are made on every core while the servers wait; between the rounds
        # the pool's processes sleep on a pipe
        pool = stack.enter_context(
            ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("spawn"))
        )
        payloads = None
        if args.plans:
            # two systems on the aiomm server's one URL and process, one at a time
            servers = {
                system: servers[server]
                for system, (server, _) in PLAN_SYSTEMS.items()
                if server in servers
            }
            payloads = {system: payload for system, (_, payload) in PLAN_SYSTEMS.items()}
        warmed = warm(servers, args, pool, payloads)
        raw = measure(servers, args, pool, payloads)
    results = _combine(raw)
    load = os.getloadavg()
    print(
        f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"on {os.cpu_count()} cores (other jobs share this machine)"
    )
    w = max([7, *(len(r.server) for r in results)])
    header = f"{'server':{w}} {'c':>3} {'img/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/img':>10}"
    print(header + f" {'cores':>6} {'load gen':>8} {'idle':>5} {'MB recv':>8}")
    for r in results:
        print(
            f"{r.server:{w}} {r.concurrency:>3} {r.images_per_s:>7} {r.p50_ms:>8} {r.p99_ms:>8} "
            f"{r.server_cpu_ms_per_image:>10} {r.server_cores_busy:>6} {r.client_cores:>8} "
            f"{r.machine_idle_cores:>5} {r.mb_received:>8}"
        )
    for r in warmed:
        print(
            f"warm-up {r.server}: {r.requests} requests, {r.images} images at c={r.concurrency}: "
            f"{r.images_per_s} images/s, {r.server_cpu_ms_per_image} CPU ms/image"
        )
    by = {(r.server, r.concurrency): r for r in results}
    b_label = args.compare_flags if args.compare_build is None else str(args.compare_build)
    against = {"aiomm-b": f"aiomm/aiomm-b ({b_label})", "vllm": "aiomm/vLLM"}
    for c in args.concurrency:
        a = by.get(("aiomm", c))
        for other, label in against.items():
            b = by.get((other, c))
            if a and b:
                print(
                    f"c={c}: {label} images/s x{a.images_per_s / b.images_per_s:.2f}, "
                    f"CPU per image x{a.server_cpu_ms_per_image / b.server_cpu_ms_per_image:.2f}, "
                    f"p50 x{a.p50_ms / b.p50_ms:.2f}"
                )
    report: dict[str, Any] = {
        "combined": [_row(r) for r in results],
        "rounds": [_row(r) for r in raw],
        "warm": [_row(r) for r in warmed],
    }
    if args.plans:
        report["ratios"] = plan_ratios(results)
        print("\n".join(plan_ratio_lines(report["ratios"])))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
