"""aiomm against smg's Rust router and vLLM's render server: the same images, one run.

Three systems run side by side on loopback, each on the same model folder (a Qwen3-VL folder by
default), every cache off:

- ``aiomm``: ``aiomm serve FOLDER --cache-gb 0``, requests to ``/v1/chat/completions/render``
  (uint8 pixels: aiomm's default for a model that normalises on its device);
- ``smg``: ``smg launch --mm-processing router --mm-pixel-cache-mb 0`` from its own venv
  (``--smg-venv``), with the stand-in engine ``smg_worker.py`` behind it (it advertises
  ``mm_device_do_normalize``, so the router sends uint8 pixels); requests to
  ``/v1/chat/completions`` (one token answered); ``--smg-turbojpeg DIR`` puts a libjpeg-turbo
  unpacked there (``dpkg -x``) on smg's ``LD_LIBRARY_PATH`` only, and the output says whether
  smg's process mapped it;
- ``vllm``: ``vllm launch render FOLDER --mm-processor-cache-gb 0`` (``--vllm-venv``; optional).

The load is :mod:`render_bench`'s: seeded closed-loop requests of 1-2 distinct JPEGs (``--sizes``,
640x480 to 1920x1080), every body built before the clock, the same bodies for every system
(images before the text in each message, as smg puts them for Qwen3-VL), the systems in
alternating rounds (A B C, then C B A). Reported per system: images/s, latency p50/p99, server
CPU ms per image (utime+stime from ``/proc``; smg: the router's process; the stand-in worker's
CPU is reported as its own row, the cost of receiving the tensors), and exactness: for the
first ``--exact-requests`` requests of a plan of their own, sent one at a time before the
rounds, each image's uint8 pixels as the system delivered them (aiomm, vLLM: decoded from the
render response; smg: as the stand-in received them) against the HF processor's with
``do_rescale=False, do_normalize=False`` (aiomm's offline reference processor of the folder's
architecture, checked to have the folder's parameters). Then the ratios aiomm/smg and
aiomm/vLLM of CPU per image and images/s.

    python bench/peers --smg-venv /tmp/smg-venv --smg-turbojpeg /tmp/smg-turbojpeg \\
        --vllm-venv /tmp/vllm-venv --n 300 --concurrency 8 --rounds 2 --json peers.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import render_bench as rb

from . import exactness as ex

__all__ = ("SYSTEMS", "main", "parse_args", "ratios", "system_bodies")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("smg_worker.py")
#: every system, in the order of a round's first half
SYSTEMS = ("aiomm", "smg", "vllm")
#: the path each system is sent its requests on
PATHS = {
    "aiomm": "/v1/chat/completions/render",
    "smg": "/v1/chat/completions",
    "vllm": "/v1/chat/completions/render",
}
#: ports from ``--port-base``: each server, smg's metrics and the stand-in engine
PORT_OFFSETS = {"aiomm": 0, "vllm": 1, "smg": 2, "smg-metrics": 3, "smg-worker": 4}
#: the exactness plan's seed is this far from ``--seed`` (as render_bench's warm-up plan)
EXACT_SEED_OFFSET = 2 * 10**6
#: where the stand-in engine's library folder is inside an unpacked ``libturbojpeg0`` package
TURBOJPEG_LIB = "usr/lib/x86_64-linux-gnu"
JSON = {"content-type": "application/json"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked.

    :raises SystemExit: bad arguments (argparse's exit code 2).
    """
    parser = argparse.ArgumentParser(prog="python bench/peers", description=__doc__.split("\n")[0])
    parser.add_argument("--model-folder", default="/tmp/vllm-probe/qwen3vl")
    parser.add_argument("--smg-venv", help="a venv with smg 1.13, smg-grpc-proto and grpcio")
    parser.add_argument(
        "--smg-turbojpeg",
        help="libjpeg-turbo unpacked here (dpkg -x libturbojpeg0_*.deb DIR): on smg's "
        "LD_LIBRARY_PATH only",
    )
    parser.add_argument("--vllm-venv", help="a venv with vllm 0.33 (vllm launch render)")
    parser.add_argument("--n", type=int, default=120, help="requests per level and round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per level")
    parser.add_argument("--sizes", default="640x480,1280x720,1600x900,1920x1080")
    parser.add_argument("--two-image-frac", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm", type=int, default=16, help="requests each system answers before the rounds"
    )
    parser.add_argument(
        "--exact-requests", type=int, default=6, help="requests whose pixels are checked"
    )
    parser.add_argument("--port-base", type=int, default=18230, help="five ports from here")
    parser.add_argument("--workers", type=int, default=1, help="aiomm serve --workers")
    parser.add_argument("--aiomm-flags", default="", help="extra flags of aiomm serve")
    parser.add_argument("--smg-flags", default="", help="extra flags of smg launch")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/aiomm-peers-bench"))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("n", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be 1 or more, got {getattr(args, name)}")
    if args.warm < 0 or args.exact_requests < 0:
        parser.error("--warm and --exact-requests must be 0 or more")
    if any(c < 1 for c in args.concurrency):
        parser.error(f"--concurrency must be 1 or more, got {args.concurrency}")
    if not 0 <= args.two_image_frac <= 1:
        parser.error(f"--two-image-frac must be in [0, 1], got {args.two_image_frac}")
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be WxH,WxH,..., got {args.sizes!r}")
    if any(len(s) != 2 or min(s) < 1 for s in sizes):
        parser.error(f"--sizes must be WxH,WxH,..., got {args.sizes!r}")
    if args.smg_turbojpeg and not args.smg_venv:
        parser.error("--smg-turbojpeg needs --smg-venv")
    if args.smg_turbojpeg and turbojpeg_dir(Path(args.smg_turbojpeg)) is None:
        parser.error(f"no libturbojpeg.so.0 under {args.smg_turbojpeg}")
    for venv, exe in ((args.smg_venv, "smg"), (args.vllm_venv, "vllm")):
        if venv and not (Path(venv) / "bin" / exe).exists():
            parser.error(f"{venv}/bin/{exe} does not exist")
    # render_bench's plan: distinct images, whole tensors asked of the render servers
    args.repeat_frac, args.mm_payload = 0.0, "tensors"
    return args


def turbojpeg_dir(root: Path) -> Path | None:
    """The folder holding ``libturbojpeg.so.0`` under ``root`` (an unpacked package or the
    library folder itself), or None."""
    for candidate in (root, root / TURBOJPEG_LIB):
        if (candidate / "libturbojpeg.so.0").exists():
            return candidate
    return None


def images_first(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with each message's images before its text (their order kept)."""
    messages = []
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, list):
            images = [p for p in content if p.get("type") != "text"]
            texts = [p for p in content if p.get("type") == "text"]
            message = {**message, "content": images + texts}
        messages.append(message)
    return {**body, "messages": messages}


def system_bodies(bodies: Sequence[bytes], system: str) -> list[bytes]:
    """:func:`render_bench.build_bodies`'s ``bodies`` as ``system`` is sent them: images first;
    for smg, a chat completion of one token (no ``mm_payload``), for the render servers the
    render request with whole tensors."""
    out = []
    for raw in bodies:
        body = images_first(json.loads(raw))
        if system == "smg":
            body.pop("mm_payload", None)
            body["max_tokens"] = 1
        out.append(json.dumps(body).encode())
    return out


@dataclass
class Running:
    """A started system: where its requests go, the process measured, and others to report."""

    url: str
    pid: int
    #: the stand-in engine's pid (smg only): its CPU is reported as its own row
    worker_pid: int | None = None


class _Worker:
    """The stand-in engine as a subprocess, ready once its port listens."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.port = port
        self.log = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=log.parent)

    def __enter__(self) -> _Worker:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stand-in engine exited with {self.proc.returncode}")
            if rb.listening_sockets(self.port):
                return self
            time.sleep(0.2)
        raise RuntimeError("the stand-in engine did not listen")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_smg_ready(url: str, model: str, timeout_s: float = 120) -> None:
    """Until smg lists its worker as ready and answers a text chat request.

    :raises RuntimeError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    last = ""
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(url + "/workers", timeout=5).json().get("workers", [])
            if any(w.get("status") == "ready" for w in workers):
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
                if r.status_code == 200:
                    return
                last = f"{r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise RuntimeError(f"smg did not become ready: {last}")


def maps_library(pid: int, name: str) -> bool:
    """Whether process ``pid`` has a library whose path contains ``name`` mapped."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def start_systems(
    stack: contextlib.ExitStack, args: argparse.Namespace, env: dict[str, str]
) -> tuple[dict[str, Running], dict[str, Any]]:
    """Start every system asked for; each one's :class:`Running` and the conditions to report
    (commands, smg's libjpeg-turbo folder).

    :raises RuntimeError: one of the ports is taken, or a system did not start.
    """
    folder = args.model_folder
    ports = {name: args.port_base + off for name, off in PORT_OFFSETS.items()}
    # a server left on a port would answer in place of the one started here
    taken = [f"{name} {port}" for name, port in ports.items() if rb.listening_sockets(port)]
    if taken:
        raise RuntimeError(f"ports already listening: {', '.join(taken)} (see --port-base)")
    logs: Path = args.logs
    running: dict[str, Running] = {}
    conditions: dict[str, Any] = {"commands": {}}

    cmd = rb.aiomm_command(args, ports["aiomm"], shlex.split(args.aiomm_flags))
    conditions["commands"]["aiomm"] = shlex.join(["aiomm", *cmd[1:]])
    server = stack.enter_context(rb.Server(cmd, env, ports["aiomm"], logs / "aiomm.log"))
    running["aiomm"] = Running(server.url + PATHS["aiomm"], server.proc.pid)

    if args.smg_venv:
        venv = Path(args.smg_venv)
        dump = logs / "smg-received"
        shutil.rmtree(dump, ignore_errors=True)
        worker_cmd = [str(venv / "bin" / "python"), str(WORKER), "--port"]
        worker_cmd += [str(ports["smg-worker"]), "--model-folder", folder]
        if args.exact_requests:
            worker_cmd += ["--dump", str(dump), "--dump-limit", str(args.exact_requests)]
        worker = stack.enter_context(_Worker(worker_cmd, ports["smg-worker"], logs / "worker.log"))
        smg = [str(venv / "bin" / "smg"), "launch", "--host", "127.0.0.1"]
        smg += ["--port", str(ports["smg"]), "--prometheus-host", "127.0.0.1"]
        smg += ["--prometheus-port", str(ports["smg-metrics"])]
        smg += ["--worker-urls", f"grpc://127.0.0.1:{ports['smg-worker']}"]
        smg += ["--model-path", folder, "--mm-processing", "router"]
        # its pixel cache off; one worker: no cache-aware routing tree to keep
        smg += ["--mm-pixel-cache-mb", "0", "--policy", "round_robin", "--log-level", "warn"]
        smg += shlex.split(args.smg_flags)
        smg_env = {k: v for k, v in env.items() if not k.startswith("SMG_")}
        lib = turbojpeg_dir(Path(args.smg_turbojpeg)) if args.smg_turbojpeg else None
        if lib is not None:
            smg_env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p
            )
        conditions["commands"]["smg"] = shlex.join(["smg", *smg[1:]])
        conditions["commands"]["smg-worker"] = shlex.join(["python", *worker_cmd[1:]])
        conditions["smg_turbojpeg_dir"] = str(lib) if lib else None
        server = stack.enter_context(rb.Server(smg, smg_env, ports["smg"], logs / "smg.log"))
        wait_smg_ready(server.url, folder)
        running["smg"] = Running(server.url + PATHS["smg"], server.proc.pid, worker.proc.pid)
        conditions["smg_received"] = str(dump)

    if args.vllm_venv:
        vllm = [f"{args.vllm_venv}/bin/vllm", "launch", "render", folder, "--host", "127.0.0.1"]
        vllm += ["--port", str(ports["vllm"]), "--limit-mm-per-prompt", '{"video": 0}']
        vllm += ["--mm-processor-cache-gb", "0", "--disable-uvicorn-access-log"]
        venv_env = {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"}
        venv_env["DO_NOT_TRACK"] = "1"
        conditions["commands"]["vllm"] = shlex.join(["vllm", *vllm[1:]])
        server = stack.enter_context(rb.Server(vllm, venv_env, ports["vllm"], logs / "vllm.log"))
        running["vllm"] = Running(server.url + PATHS["vllm"], server.proc.pid)
    return running, conditions


def reference_processor(folder: Path) -> Any:
    """aiomm's offline HF image processor of the folder's architecture, with the folder's
    parameters.

    :raises RuntimeError: its parameters differ from the folder's ``preprocessor_config.json``.
    """
    from aiomm.adapters import get_adapter_info

    config = json.loads((folder / "config.json").read_text())
    info = get_adapter_info(config["architectures"][0])
    processor = info.build_hf_processor().image_processor
    differ = ex.check_params(
        processor, json.loads((folder / "preprocessor_config.json").read_text())
    )
    if differ:
        raise RuntimeError(f"{info.short_name}'s reference differs from {folder}: {differ}")
    return processor


def check_exactness(
    running: dict[str, Running], args: argparse.Namespace, received: Path | None
) -> dict[str, dict[str, Any]]:
    """Each system's pixels for the exactness plan's images against the HF processor's; the
    requests go one at a time (smg's are matched to what the worker wrote by their order)."""
    if not args.exact_requests:
        return {}
    plan = argparse.Namespace(**{**vars(args), "n": args.exact_requests})
    bodies, _ = rb.build_bodies(plan, args.seed + EXACT_SEED_OFFSET)
    processor = reference_processor(Path(args.model_folder))
    references = [[ex.hf_pixels(processor, jpeg) for jpeg in ex.body_images(b)] for b in bodies]
    out = {}
    with httpx.Client(timeout=300) as client:
        for name, system in running.items():
            result = ex.SystemExactness(name)
            for i, body in enumerate(system_bodies(bodies, name)):
                r = client.post(system.url, content=body, headers=JSON)
                if r.status_code != 200:
                    raise RuntimeError(f"{name}: {r.status_code} {r.text[:300]}")
                if name == "smg":
                    assert received is not None
                    delivered = ex.received_images(received, i)
                else:
                    delivered = ex.render_images(r.json())
                ex.check_images(result, delivered, references[i])
            out[name] = result.summary()
    return out


def _level_with_worker(
    name: str, system: Running, c: int, bodies: list[bytes], images: int, phase: str
) -> tuple[rb.LevelResult, rb.LevelResult | None]:
    """:func:`render_bench._level` of one system; for smg also the stand-in engine's CPU over
    the same window, as a row of its own (its wall time and images are smg's)."""
    worker0 = rb._cpu_s(system.worker_pid) if system.worker_pid else 0.0
    result = rb._level(name, system.url, system.pid, c, bodies, images, phase)
    if system.worker_pid is None:
        return result, None
    cpu = rb._cpu_s(system.worker_pid) - worker0
    worker = rb.LevelResult(
        f"{name}-worker", c, result.requests, images, result.wall_s, result.images_per_s,
        0.0, 0.0, round(cpu * 1000 / images, 1), round(cpu / result.wall_s, 2),
        result.mb_received, 0.0, 0.0, round(cpu, 3),
    )  # fmt: skip
    return result, worker


def _plans(args: argparse.Namespace, pool: Executor) -> Iterator[tuple[int, int, list[bytes], int]]:
    """Each level and round's plan (seeded as render_bench.measure seeds them): its
    concurrency, its round, its bodies and their image count."""
    for level, c in enumerate(args.concurrency):
        for r in range(args.rounds):
            bodies, images = rb.build_bodies(args, args.seed + 1000 * level + r, pool)
            yield c, r, bodies, images


def measure(
    running: dict[str, Running], args: argparse.Namespace, pool: Executor
) -> tuple[list[rb.LevelResult], list[rb.LevelResult]]:
    """Every level and round on every system, alternating (round r: in order, then reversed);
    the rows measured and the stand-in engine's rows."""
    out: list[rb.LevelResult] = []
    workers: list[rb.LevelResult] = []
    names = list(running)
    for c, r, bodies, images in _plans(args, pool):
        per_system = {name: system_bodies(bodies, name) for name in names}
        for name in names if r % 2 == 0 else reversed(names):
            result, worker = _level_with_worker(
                name, running[name], c, per_system[name], images, "round"
            )
            out.append(result)
            if worker is not None:
                workers.append(worker)
    return out, workers


def warm(
    running: dict[str, Running], args: argparse.Namespace, pool: Executor
) -> list[rb.LevelResult]:
    """Each system answers ``--warm`` requests of images of their own first."""
    if not args.warm:
        return []
    bodies, images = rb.warm_plan(args, pool)
    c = max(args.concurrency)
    return [
        _level_with_worker(name, system, c, system_bodies(bodies, name), images, "warm")[0]
        for name, system in running.items()
    ]


def ratios(results: Sequence[rb.LevelResult]) -> list[dict[str, Any]]:
    """Per level: aiomm over smg and over vLLM, of CPU per image and of images/s (from the
    CPU seconds measured, not the rounded table); a system not measured is left out."""
    by = {(r.server, r.concurrency): r for r in results}
    out = []
    for c in dict.fromkeys(r.concurrency for r in results):
        a = by.get(("aiomm", c))
        row: dict[str, Any] = {"concurrency": c}
        for other in ("smg", "vllm"):
            b = by.get((other, c))
            if a and b:
                row[f"cpu_per_image_aiomm_over_{other}"] = rb._ratio(
                    a.cpu_ms_per_image, b.cpu_ms_per_image
                )
                row[f"images_per_s_aiomm_over_{other}"] = rb._ratio(a.images_per_s, b.images_per_s)
        out.append(row)
    return out


def ratio_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """:func:`ratios` as printed lines."""
    lines = []
    for row in rows:
        for other, label in (("smg", "aiomm/smg"), ("vllm", "aiomm/vLLM")):
            cpu = row.get(f"cpu_per_image_aiomm_over_{other}", "absent")
            if cpu == "absent":
                continue
            ips = row[f"images_per_s_aiomm_over_{other}"]
            lines.append(
                f"c={row['concurrency']}: {label}: CPU per image {rb._times(cpu)}, "
                f"images/s {rb._times(ips)}"
            )
    return lines


def table_lines(results: Sequence[rb.LevelResult]) -> list[str]:
    """The side-by-side table of :func:`render_bench._combine`'s rows."""
    w = max([10, *(len(r.server) for r in results)])
    lines = [
        f"{'system':{w}} {'c':>3} {'img/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/img':>10} "
        f"{'cores':>6} {'load gen':>8} {'idle':>5} {'MB recv':>8}"
    ]
    for r in results:
        # a worker row shares its system's requests: only its CPU is its own
        own = not r.server.endswith("-worker")
        ips, p50, p99, gen, idle, mb = (
            (r.images_per_s, r.p50_ms, r.p99_ms, r.client_cores, r.machine_idle_cores,
             r.mb_received) if own else ("-",) * 6
        )  # fmt: skip
        lines.append(
            f"{r.server:{w}} {r.concurrency:>3} {ips:>7} {p50:>8} {p99:>8} "
            f"{r.server_cpu_ms_per_image:>10} {r.server_cores_busy:>6} {gen:>8} {idle:>5} {mb:>8}"
        )
    return lines


def exactness_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The exactness table: per system, images equal to HF's and how far the others are."""
    lines = [f"{'system':10} {'images':>6} {'equal':>6} {'grids':>6} {'max |diff|':>10} "
             f"{'differing':>10}"]  # fmt: skip
    for name, s in summaries.items():
        lines.append(
            f"{name:10} {s['images']:>6} {s['equal_images']:>6} {s['grids_equal']:>6} "
            f"{s['max_abs_diff']:>10} {s['share_differing']:>10.2%}"
        )
    return lines


def _version(python: str, package: str) -> str:
    """``package``'s installed version in the interpreter ``python`` (its metadata only)."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    folder = Path(args.model_folder).resolve()
    args.model_folder = str(folder)
    for name in ("smg_venv", "vllm_venv"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).absolute()))
    if args.smg_turbojpeg:
        args.smg_turbojpeg = str(Path(args.smg_turbojpeg).resolve())
    args.cache_gb = 0  # aiomm_command's --cache-gb
    args.logs.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "",
    }
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        running, conditions = start_systems(stack, args, env)
        for name, cmd in conditions["commands"].items():
            print(f"{name}: {cmd}", flush=True)
        received = Path(conditions["smg_received"]) if "smg_received" in conditions else None
        exact = check_exactness(running, args, received)
        if "smg" in running:
            # mapped once smg decoded a JPEG (the exactness requests or the warm-up)
            conditions["smg_libjpeg_turbo"] = maps_library(running["smg"].pid, "libturbojpeg")
        pool = stack.enter_context(
            ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("spawn"))
        )
        warmed = warm(running, args, pool)
        if "smg" in running and "smg_libjpeg_turbo" not in conditions:
            conditions["smg_libjpeg_turbo"] = maps_library(running["smg"].pid, "libturbojpeg")
        raw, worker_raw = measure(running, args, pool)
    results = rb._combine(raw)
    worker_rows = rb._combine(worker_raw)
    load_end = os.getloadavg()
    conditions.update(
        commit=_commit(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        cores=os.cpu_count(),
        load_average_start=[round(v, 2) for v in load_start],
        load_average_end=[round(v, 2) for v in load_end],
        model_folder=args.model_folder,
        argv=list(sys.argv[1:] if argv is None else argv),
        versions={
            package: _version(python, package)
            for package, python in (
                ("aiomm", sys.executable),
                ("smg", args.smg_venv and f"{args.smg_venv}/bin/python"),
                ("vllm", args.vllm_venv and f"{args.vllm_venv}/bin/python"),
            )
            if python
        },
    )
    if "smg" in running:
        turbo = conditions.get("smg_libjpeg_turbo")
        where = conditions.get("smg_turbojpeg_dir") or "none given"
        print(f"\nsmg ran {'with' if turbo else 'WITHOUT'} libjpeg-turbo (folder: {where})")
    print(
        f"load average: {' '.join(f'{v:.2f}' for v in load_start)} at the start, "
        f"{' '.join(f'{v:.2f}' for v in load_end)} at the end, on {os.cpu_count()} cores "
        f"(other jobs share this machine); commit {conditions['commit']}; "
        + ", ".join(f"{k} {v}" for k, v in conditions["versions"].items())
    )
    print("\n".join(table_lines([*results, *worker_rows])))
    if worker_rows:
        print("(smg-worker: the stand-in engine receiving smg's tensors, in smg's rounds)")
    if exact:
        print("\nexactness against the HF processor (uint8, do_rescale/do_normalize off):")
        print("\n".join(exactness_lines(exact)))
    report_ratios = ratios(results)
    print("\n" + "\n".join(ratio_lines(report_ratios)))
    if args.json:
        report = {
            "conditions": conditions,
            "combined": [rb._row(r) for r in results],
            "worker": [rb._row(r) for r in worker_rows],
            "rounds": [rb._row(r) for r in raw],
            "worker_rounds": [rb._row(r) for r in worker_raw],
            "warm": [rb._row(r) for r in warmed],
            "exactness": exact,
            "ratios": report_ratios,
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0
