"""``aiomm run``: stream images through the engine, write JSON lines, print a summary.

With no sources it runs on the embedded defaults: the Qwen2-VL adapter built offline and sample
images generated into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import anyio

from aiomm.config import EngineConfig
from aiomm.engine._stats import percentile
from aiomm.logging import configure_logging
from aiomm.media.fetch import FetchConfig
from aiomm.media.image import DecodeConfig
from aiomm.types import Request, Result

if TYPE_CHECKING:
    from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder

__all__ = ("main",)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


def _expand_sources(sources: Sequence[str]) -> list[str]:
    out: list[str] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            out.extend(str(p) for p in sorted(path.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES)
        else:
            out.append(source)
    return out


def _requests(
    sources: list[str], per_request: int, repeats: int, placeholder: str
) -> Iterator[Request]:
    """Requests of ``per_request`` images each; ``placeholder`` is one image's placeholder text
    as the adapter's chat template writes it."""
    index = 0
    for _ in range(repeats):
        for start in range(0, len(sources), per_request):
            images = sources[start : start + per_request]
            text = " ".join(["describe the image", *[placeholder] * len(images), "please"])
            yield Request(prompt=text, images=images, request_id=f"req-{index:05d}")
            index += 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiomm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream images through the engine")
    run.add_argument("sources", nargs="*", help="image files, folders or URLs")
    run.add_argument("--model", default="qwen2-vl", help="architecture, short name or folder")
    run.add_argument("--backend", choices=["torchvision", "pil"], default="torchvision")
    run.add_argument("--output", type=Path, help="JSON lines output (default: in a temp folder)")
    run.add_argument("--images-per-request", type=int, default=1)
    run.add_argument("--repeats", type=int, default=1, help="pass over the sources N times")
    run.add_argument("--threads", type=int, help="transform threads (default: one per core)")
    run.add_argument("--max-in-flight", type=int, default=16)
    run.add_argument("--samples", type=int, default=24, help="sample images without sources")
    run.add_argument("--allowed-root", type=Path, help="local files allowed under this folder")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument(
        "--shared-cache", metavar="URL", help="Redis item cache shared by replicas (redis://...)"
    )
    serve = sub.add_parser("serve", help="vLLM's render API and an OpenAI gateway over HTTP")
    serve.add_argument(
        "model",
        help="model folder (config, processor, tokenizer, template), or a registered short name "
        "(its offline reference folder: a word-level tokenizer, for trying the server)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--shared-cache", metavar="URL", help="Redis item cache shared by replicas (redis://...)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--upstream", help="URL of `vllm serve --tokens-only` (gateway mode)")
    serve.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` (any of the keys) on /v1, /v2, /inference and "
        "/cohere, as vLLM's --api-key does (a 401 otherwise; /health, /ready, /metrics and "
        "/tokenize stay open); default: the VLLM_API_KEY environment variable (one key), which "
        "keeps the key off the command line and out of ps; give the model before this flag",
    )
    serve.add_argument(
        "--upstream-api-key",
        metavar="KEY",
        help="the upstream engine's own --api-key, sent as `Authorization: Bearer KEY` on "
        "gateway requests (a client's key is never forwarded); default: the "
        "AIOMM_UPSTREAM_API_KEY environment variable",
    )
    serve.add_argument("--workers", type=int, default=1, help="server processes")
    serve.add_argument(
        "--transform-threads",
        type=int,
        help="decode/resize threads per process (default: one per core)",
    )
    serve.add_argument(
        "--busy-transform-threads",
        type=int,
        help="of those, the ones that run at once while a process has two or more requests in "
        "flight (default with --workers N: cores / N, at least 1; with one worker: all)",
    )
    serve.add_argument(
        "--pin-workers",
        action="store_true",
        help="with --workers N: each worker runs on its own share of the cores (Linux; for a "
        "host that runs this server alone)",
    )
    serve.add_argument(
        "--no-peer-cache",
        action="store_true",
        help="with --workers: each worker caches only its own items (default: a worker that "
        "misses copies the item from the worker that computed it)",
    )
    serve.add_argument(
        "--cache-gb",
        "--mm-processor-cache-gb",
        type=float,
        help="GiB of items cached in memory by the whole server, each of --workers N caching "
        "an N-th (vLLM's flag of this name is per process; with one worker they agree; "
        "default: 4; 0: none in memory)",
    )
    serve.add_argument(
        "--cache-pretouch",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="fault in each process's cache budget before serving, so the cache's growth "
        "costs no page faults under load; the budget's memory is then held from the start and "
        "start-up takes seconds per GiB (default: off, the cache grows on demand)",
    )
    serve.add_argument("--served-model-name", nargs="*", default=[], help="names clients use")
    serve.add_argument(
        "--model-id", help="id items are hashed with: the path vLLM was given (default: model)"
    )
    serve.add_argument("--allowed-local-media-path", help="file: URLs allowed under this folder")
    serve.add_argument("--max-images", type=int, default=16, help="images per request")
    serve.add_argument("--max-videos", type=int, default=4, help="videos per request")
    serve.add_argument("--max-body-mb", type=int, default=64)
    serve.add_argument("--request-timeout", type=float, default=120.0, help="seconds")
    sub.add_parser(
        "bench", add_help=False, help="streaming benchmark (bench/stream_bench/; --help)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aiomm`` command."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        return _serve(args)
    configure_logging(level="WARNING")
    with tempfile.TemporaryDirectory(prefix="aiomm-run-") as tmp:
        sources = _expand_sources(args.sources)
        root = args.allowed_root
        if not sources:
            from aiomm.media.samples import write_samples

            sources = [str(p) for p in write_samples(Path(tmp) / "samples", args.samples)]
            root = Path(tmp)
            # the embedded defaults show the cache at work: every image is seen twice
            args.repeats = max(args.repeats, 2)
        if root is None:
            # Paths named on the command line are the user's own choice: allow the filesystem.
            root = Path(Path.cwd().anchor)
        output = args.output or Path(tempfile.gettempdir()) / "aiomm-run-results.jsonl"
        return anyio.run(_run, args, sources, root, output, backend_options=_backend())


def _serve(args: argparse.Namespace) -> int:
    """``aiomm serve``: needs the ``serve`` extra."""
    try:
        from aiomm.server import ServerConfig
        from aiomm.server.auth import api_keys, upstream_api_key
        from aiomm.server.render import RenderLimits
        from aiomm.server.runtime.supervisor import ListenError
        from aiomm.server.serve import serve
    except ImportError as exc:
        print(f"aiomm serve needs the serve extra: pip install 'aiomm[serve]' ({exc})")
        return 2
    if not Path(args.model).is_dir():
        from aiomm.adapters import get_adapter_info
        from aiomm.errors import UnknownArchitectureError

        try:
            get_adapter_info(args.model)  # a short name serves its offline reference folder
        except UnknownArchitectureError as exc:
            print(f"aiomm serve: {args.model} is not a model folder nor a registered name: {exc}")
            return 2
    for flag in ("transform_threads", "busy_transform_threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            name = "--" + flag.replace("_", "-")
            print(f"aiomm serve: {name} must be at least 1, got {value}")
            return 2
    if args.pin_workers and not hasattr(os, "sched_setaffinity"):
        print("aiomm serve: --pin-workers needs Linux (os.sched_setaffinity)")
        return 2
    if args.cache_gb is not None and not (math.isfinite(args.cache_gb) and args.cache_gb >= 0):
        print(f"aiomm serve: --cache-gb must be 0 or more, got {args.cache_gb}")
        return 2
    configure_logging(level="INFO", json=True)  # one JSON line per request
    config = ServerConfig(
        model=args.model,
        model_id=args.model_id,
        served_model_names=tuple(args.served_model_name),
        upstream=args.upstream,
        max_body_bytes=args.max_body_mb << 20,
        limits=RenderLimits(
            max_images=args.max_images,
            max_videos=args.max_videos,
            timeout_s=args.request_timeout,
        ),
        allowed_local_media_path=args.allowed_local_media_path,
        shared_cache_url=args.shared_cache,
        transform_threads=args.transform_threads,
        busy_transform_threads=args.busy_transform_threads,
        cache_bytes=None if args.cache_gb is None else int(args.cache_gb * 2**30),
        cache_pretouch=args.cache_pretouch,
        tuned=True,  # the server owns its process (aiomm.tuning)
        api_keys=api_keys(args.api_key),
        upstream_api_key=upstream_api_key(args.upstream_api_key),
    )
    try:
        return serve(
            config,
            host=args.host,
            port=args.port,
            workers=args.workers,
            peer_cache=not args.no_peer_cache,
            pin_workers=args.pin_workers,
        )
    except ListenError as exc:  # the workers' address (one process: uvicorn reports it itself)
        print(f"aiomm serve: {exc}")
        return 2


def _bench(argv: list[str]) -> int:
    """Run the ``stream_bench`` package: it lives in the source checkout's bench/, not in aiomm."""
    import importlib

    bench = Path(__file__).resolve().parents[1] / "bench"
    if not (bench / "stream_bench" / "__init__.py").is_file():
        print(
            "aiomm bench needs a source checkout (an editable install): "
            f"{bench / 'stream_bench'} not found"
        )
        return 2
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    return int(importlib.import_module("stream_bench.cli").main(argv))


def _backend() -> dict[str, object]:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - Windows
        return {}
    return {"use_uvloop": True}


async def _run(args: argparse.Namespace, sources: list[str], root: Path | None,
               output: Path) -> int:  # fmt: skip
    from aiomm.engine import Engine
    from aiomm.tuning import tuned

    kwargs = {} if args.threads is None else {"transform_threads": args.threads}
    # `aiomm run` owns its process: the process-wide settings measured worth it (aiomm.tuning)
    config = tuned(
        EngineConfig(
            max_in_flight=args.max_in_flight,
            fetch=FetchConfig(allowed_local_root=root),
            decode=DecodeConfig(),
            shared_cache_url=args.shared_cache,
            **kwargs,
        )
    )
    engine = Engine.from_pretrained(args.model, config, backend=args.backend)
    # every built-in adapter has dummy inputs (one without fails here, as it always did)
    dummy_inputs = cast("BaseDummyInputsBuilder", engine.processor.dummy_inputs)
    placeholder = dummy_inputs.get_dummy_text({"image": 1})
    requests = list(_requests(sources, args.images_per_request, args.repeats, placeholder))
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(requests), unit="req", file=sys.stderr, leave=False)
    results: list[Result] = []
    t0 = time.perf_counter()
    async with engine:
        with output.open("w") as sink:
            async with engine.stream(requests, max_in_flight=args.max_in_flight) as stream:
                async for result in stream:
                    results.append(result)
                    sink.write(json.dumps(result.summary()) + "\n")
                    if progress is not None:
                        progress.update(1)
        elapsed = time.perf_counter() - t0
        stats = engine.stats()
    if progress is not None:
        progress.close()
    _print_summary(results, elapsed, stats, output)
    return 0 if all(r.ok for r in results) else 1


def _print_summary(results: list[Result], elapsed: float, stats: object, output: Path) -> None:
    ok = [r for r in results if r.ok]
    images = sum(len(r.cache) for r in ok)
    latencies = sorted(r.timings.get("total", 0.0) for r in ok)

    def latency(q: float) -> str:
        return f"{percentile(latencies, q) * 1000:.1f} ms" if latencies else "-"

    outcomes = [c.value for r in ok for c in r.cache]
    hits = sum(o in ("hit", "joined", "shared_hit", "shared_joined") for o in outcomes)
    rows = [
        ("requests", f"{len(results)} ({len(results) - len(ok)} failed)"),
        ("images", str(images)),
        ("wall time", f"{elapsed:.2f} s"),
        ("images/s", f"{images / elapsed:.1f}" if elapsed else "-"),
        ("requests/s", f"{len(results) / elapsed:.1f}" if elapsed else "-"),
        ("latency p50", latency(50)),
        ("latency p99", latency(99)),
        ("cache hit rate", f"{hits / len(outcomes):.0%}" if outcomes else "-"),
        ("results", str(output)),
    ]
    width = max(len(k) for k, _ in rows)
    print("aiomm run summary")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    for r in results:
        if not r.ok:
            print(f"  error {r.request_id}: {type(r.error).__name__}: {r.error}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
