"""``aiomm``: ``run`` streams images (or audio clips, for a model that takes audio) through the
engine, writes JSON lines and prints a summary; ``serve`` is vLLM's render API and an OpenAI
gateway; ``standin`` a stand-in upstream engine.

With no sources ``aiomm run`` runs on the embedded defaults: the Qwen2-VL adapter built offline
and sample images (sample clips for an audio model) generated into a temporary folder. Relative
paths are taken from the working directory. This module imports nothing heavy (torch, numpy,
the engine) until a command runs.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiomm.types import Request, Result

__all__ = ("main",)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm"}
DEFAULT_OUTPUT = Path("aiomm-results.jsonl")
# A scheme needs two or more characters, so a Windows drive letter ("C:\\x") stays a path.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
_DATA_URL_SHOWN = 40


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, a flag's False,
    an empty list) or where the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return text + " (default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiomm")
    except PackageNotFoundError:  # pragma: no cover - a checkout used without installing it
        return "unknown (not installed)"


def _is_url(source: str) -> bool:
    return _SCHEME.match(source) is not None


def _expand_sources(sources: Sequence[str], suffixes: set[str] = IMAGE_SUFFIXES) -> list[str]:
    out: list[str] = []
    for source in sources:
        path = Path(source)
        if not _is_url(source) and path.is_dir():
            out.extend(str(p) for p in sorted(path.iterdir()) if p.suffix.lower() in suffixes)
        else:
            out.append(source)
    return out


def _shown(source: object) -> str:
    """A source as the results show it: a data URL cut short, credentials in a URL masked."""
    from aiomm.redaction import redact

    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    if not isinstance(source, str):
        return f"<{type(source).__name__}>"
    if source[:5].lower() == "data:":
        return source[:_DATA_URL_SHOWN] + ("..." if len(source) > _DATA_URL_SHOWN else "")
    return redact(source, source=source)


def _requests(
    sources: list[str], per_request: int, repeats: int, placeholder: str, modality: str = "image"
) -> Iterator[Request]:
    """Requests of ``per_request`` items of ``modality`` (``image`` or ``audio``) each;
    ``placeholder`` is one item's placeholder text as the adapter's chat template writes it."""
    from aiomm.types import Request

    index = 0
    for _ in range(repeats):
        for start in range(0, len(sources), per_request):
            items = sources[start : start + per_request]
            text = " ".join([f"describe the {modality}", *[placeholder] * len(items), "please"])
            if modality == "audio":
                yield Request(prompt=text, audios=items, request_id=f"req-{index:05d}")
            else:
                yield Request(prompt=text, images=items, request_id=f"req-{index:05d}")
            index += 1


def _model_modality(model: str) -> str:
    """``image`` when ``model`` (a registered name or a model folder) takes images, else
    ``audio`` when it takes audio; ``image`` when that cannot be told."""
    import json

    from aiomm.adapters import get_adapter_info
    from aiomm.errors import UnknownArchitectureError

    name = model
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            name = json.loads(config.read_text())["architectures"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return "image"
    try:
        modalities = get_adapter_info(name).processor_cls.supported_modalities
    except UnknownArchitectureError:
        return "image"
    return "audio" if "image" not in modalities and "audio" in modalities else "image"


def _write_audio_samples(folder: Path, count: int) -> list[Path]:
    """``count`` sample clips (WAV, 0.5 to 4 s of tones at 16 to 44.1 kHz) in ``folder``."""
    import importlib

    import numpy as np

    soundfile: Any = importlib.import_module("soundfile")  # the audio extra
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        rate = (16000, 22050, 44100)[i % 3]
        t = np.arange(int(rate * (0.5 + 0.5 * (i % 8)))) / rate
        tone = 0.4 * np.sin(2 * np.pi * (220 + 55 * i) * t) + 0.2 * np.sin(2 * np.pi * 880 * t)
        path = folder / f"sample_{i:04d}.wav"
        soundfile.write(path, tone.astype(np.float32), rate, subtype="PCM_16")
        paths.append(path)
    return paths


def _add_fetch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="DOMAIN",
        help="fetch http(s) URLs (and their redirects) only from these hosts, exactly as "
        "named, as vLLM does (default: any host)",
    )
    parser.add_argument(
        "--allow-private-networks",
        action="store_true",
        help="also fetch URLs whose host is on loopback or a private network (10/8, 172.16/12, "
        "192.168/16, ...); cloud metadata addresses stay refused (default: refused)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiomm",
        description="aiomm: multimodal preprocessing for vision-language model serving. "
        "`aiomm run` with no arguments tries it on sample images.",
        epilog="`aiomm COMMAND --help` describes a command and its options.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"aiomm {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="stream images (or audio) through the engine, write JSON lines, print a summary",
        description="Stream images (or audio clips, for a model that takes audio) through the "
        "engine: one JSON line per request in --output, then a summary. With no sources: "
        "sample images (or clips), each sent twice to show the cache.",
        formatter_class=_HelpFormatter,
    )
    run.add_argument(
        "sources",
        nargs="*",
        help="image (or audio) files, folders or URLs; relative paths are taken from the "
        "working directory (default: generated samples)",
    )
    run.add_argument(
        "--modality",
        choices=["image", "audio"],
        help="what the sources are (default: images, or audio for a model that takes audio "
        "and no images)",
    )
    run.add_argument(
        "--model",
        default="qwen2-vl",
        help="a registered short name (its reference processor, built offline) or a local model "
        "folder",
    )
    run.add_argument(
        "--backend",
        choices=["torchvision", "pil"],
        default="torchvision",
        help="the reference processor's image backend",
    )
    run.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="JSON lines written, one per request, with its sources (default: "
        f"./{DEFAULT_OUTPUT} in the working directory)",
    )
    run.add_argument(
        "--images-per-request",
        "--items-per-request",
        dest="images_per_request",
        type=int,
        default=1,
        help="images (or audio clips) in each request",
    )
    run.add_argument("--repeats", type=int, default=1, help="pass over the sources N times")
    run.add_argument("--threads", type=int, help="transform threads (default: one per core)")
    run.add_argument("--max-in-flight", type=int, default=16, help="requests processed at once")
    run.add_argument(
        "--samples", type=int, default=24, help="sample images generated when no source is given"
    )
    run.add_argument(
        "--allowed-root",
        type=Path,
        help="read local files only under this folder (default: the working directory and the "
        "files and folders named as sources)",
    )
    _add_fetch_flags(run)
    run.add_argument(
        "--plan",
        action="store_true",
        help="routing plans only: token ids, placeholders and hashes, no pixel decoded where "
        "the header decides the size",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    run.add_argument(
        "--shared-cache",
        metavar="URL",
        help="Redis item cache shared by replicas (redis://...; default: none)",
    )
    serve = sub.add_parser(
        "serve",
        help="vLLM's render API and an OpenAI gateway over HTTP",
        description="vLLM's render API (a drop-in for `vllm launch render`) and, with "
        "--upstream, an OpenAI-compatible gateway in front of `vllm serve --tokens-only`.",
        formatter_class=_HelpFormatter,
    )
    serve.add_argument(
        "model",
        help="model folder (config, processor, tokenizer, template), or a registered short name "
        "(its offline reference folder: a word-level tokenizer, for trying the server)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument(
        "--shared-cache",
        metavar="URL",
        help="Redis item cache shared by replicas (redis://...; default: none)",
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--upstream",
        help="URL of `vllm serve --tokens-only` (gateway mode; default: render API only)",
    )
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
    serve.add_argument(
        "--served-model-name",
        nargs="*",
        default=[],
        help="names clients use (default: the model argument)",
    )
    serve.add_argument(
        "--model-id", help="id items are hashed with: the path vLLM was given (default: model)"
    )
    serve.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="file: URLs are read only under this folder, as vLLM does (default: file: URLs "
        "refused)",
    )
    _add_fetch_flags(serve)
    serve.add_argument("--max-images", type=int, default=16, help="images per request")
    serve.add_argument("--max-videos", type=int, default=4, help="videos per request")
    serve.add_argument("--max-audios", type=int, default=4, help="audio clips per request")
    serve.add_argument("--max-body-mb", type=int, default=64, help="largest request body, MiB")
    serve.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds a request may take"
    )
    standin = sub.add_parser(
        "standin",
        help="a stand-in for `vllm serve --tokens-only` answering every request with "
        "deterministic text, to try the gateway without a GPU (validates what it receives as "
        "vLLM would)",
        description="A stand-in for `vllm serve --tokens-only` answering every request with "
        "deterministic text, to try the gateway without a GPU (validates what it receives as "
        "vLLM would). Point `aiomm serve MODEL --upstream http://HOST:PORT` at it.",
        formatter_class=_HelpFormatter,
    )
    standin.add_argument("model", help="model folder, or a registered short name")
    standin.add_argument("--host", default="127.0.0.1", help="address to listen on")
    standin.add_argument("--port", type=int, default=8001, help="port to listen on")
    sub.add_parser(
        "bench",
        add_help=False,
        help="streaming benchmark (in a source checkout: bench/stream_bench/; "
        "`aiomm bench --help`)",
    )
    return parser


def _model_problem(model: str) -> str | None:
    """Why ``model`` names neither a local folder nor a registered short name (one line), or
    None when it does."""
    if Path(model).is_dir():
        return None
    from aiomm.adapters import get_adapter_info, supported_adapters
    from aiomm.errors import UnknownArchitectureError

    try:
        get_adapter_info(model)
        return None
    except UnknownArchitectureError:
        pass
    owner, slash, name = model.partition("/")
    if slash and owner and name and "/" not in name and not owner.startswith((".", "~")):
        return (
            f"{model!r} looks like a Hugging Face repo id and is not a folder here; aiomm never "
            f"downloads: run `huggingface-cli download {model} --local-dir ./{name}`, then pass "
            f"that folder: ./{name}"
        )
    names = ", ".join(info.short_name for info in supported_adapters())
    return (
        f"unknown model {model!r}: not a model folder nor a registered short name (one of: {names})"
    )


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
    if args.command == "standin":
        return _standin(args)
    return _run_command(args)


def _run_command(args: argparse.Namespace) -> int:
    """``aiomm run``."""
    if _refuses_model("run", args.model):
        return 2
    import tempfile

    import anyio

    from aiomm.logging import configure_logging

    # each failed request is printed in the summary, its source named: no warning line for it
    configure_logging(level="ERROR")
    with tempfile.TemporaryDirectory(prefix="aiomm-run-") as tmp:
        args.modality = args.modality or _model_modality(args.model)
        audio = args.modality == "audio"
        sources = _expand_sources(args.sources, AUDIO_SUFFIXES if audio else IMAGE_SUFFIXES)
        root: Path | None = args.allowed_root
        named: tuple[Path, ...] = ()
        note = None
        if not sources:
            from aiomm.media.samples import write_samples

            write = _write_audio_samples if audio else write_samples
            sources = [str(p) for p in write(Path(tmp) / "samples", args.samples)]
            root = Path(tmp)
            # the embedded defaults show the cache at work: every image is seen twice
            args.repeats = max(args.repeats, 2)
            times = "twice" if args.repeats == 2 else f"{args.repeats} times"
            note = f"each sample {'clip' if audio else 'image'} is sent {times} to show the cache"
        elif root is None:
            # the working directory, and what the command line names: the user's own choice
            root = Path.cwd()
            named = tuple(Path(s) for s in args.sources if not _is_url(s))
        return anyio.run(
            _run, args, sources, root, named, args.output, note, backend_options=_backend()
        )


def _refuses_model(command: str, model: str) -> bool:
    """Print ``aiomm COMMAND``'s one-line refusal of ``model`` when it is neither a folder nor
    a registered name (:func:`_model_problem`); whether it did."""
    problem = _model_problem(model)
    if problem is not None:
        print(f"aiomm {command}: {problem}", file=sys.stderr)
    return problem is not None


def _standin(args: argparse.Namespace) -> int:
    """``aiomm standin``: needs the ``serve`` extra."""
    try:
        from aiomm.server.standin import run
    except ImportError as exc:
        print(f"aiomm standin needs the serve extra: pip install 'aiomm[serve]' ({exc})")
        return 2
    if _refuses_model("standin", args.model):
        return 2
    return run(args.model, host=args.host, port=args.port)


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
    # a short name serves its offline reference folder
    if _refuses_model("serve", args.model):
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
    from aiomm.errors import ConfigError
    from aiomm.logging import configure_logging
    from aiomm.media.fetch import FetchConfig

    try:  # the fetch flags, checked before any process starts
        FetchConfig(allowed_media_domains=tuple(args.allowed_media_domains or ()))
    except ConfigError as exc:
        print(f"aiomm serve: --allowed-media-domains: {exc}", file=sys.stderr)
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
            max_audios=args.max_audios,
            timeout_s=args.request_timeout,
        ),
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allow_private_networks=args.allow_private_networks,
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


async def _run(
    args: argparse.Namespace,
    sources: list[str],
    root: Path | None,
    named: tuple[Path, ...],
    output: Path,
    note: str | None,
) -> int:
    import json
    import time

    from aiomm.config import EngineConfig
    from aiomm.engine import Engine
    from aiomm.errors import ConfigError
    from aiomm.media.fetch import FetchConfig
    from aiomm.media.image import DecodeConfig
    from aiomm.tuning import tuned

    kwargs = {} if args.threads is None else {"transform_threads": args.threads}
    try:
        fetch = FetchConfig(
            allowed_local_root=root,
            allowed_local_paths=named,
            local_root_setting="--allowed-root",
            allowed_media_domains=tuple(args.allowed_media_domains or ()),
            allow_loopback=args.allow_private_networks,
            allow_private_addresses=args.allow_private_networks,
        )
        # `aiomm run` owns its process: the process-wide settings measured worth it (aiomm.tuning)
        config = tuned(
            EngineConfig(
                max_in_flight=args.max_in_flight,
                fetch=fetch,
                decode=DecodeConfig(),
                shared_cache_url=args.shared_cache,
                **kwargs,
            )
        )
    except ConfigError as exc:
        print(f"aiomm run: {exc}", file=sys.stderr)
        return 2
    engine = Engine.from_pretrained(args.model, config, backend=args.backend)
    # every built-in adapter has dummy inputs (one without fails here, as it always did)
    dummy_inputs: Any = engine.processor.dummy_inputs
    modality = args.modality
    placeholder = dummy_inputs.get_dummy_text({modality: 1})
    requests = list(
        _requests(sources, args.images_per_request, args.repeats, placeholder, modality)
    )
    sources_of = {str(r.request_id): [_shown(s) for s in (*r.images, *r.audios)] for r in requests}
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(requests), unit="req", file=sys.stderr, leave=False)
    results: list[Result] = []
    t0 = time.perf_counter()
    async with engine:
        with output.open("w") as sink:
            stream_of = engine.stream(requests, max_in_flight=args.max_in_flight, plan=args.plan)
            async with stream_of as stream:
                async for result in stream:
                    results.append(result)
                    shown = sources_of.get(str(result.request_id), [])
                    row = result.summary()
                    row["sources"] = shown
                    if result.error is not None:
                        row["error"] = _error_text(result.error, shown)
                    sink.write(json.dumps(row) + "\n")
                    if progress is not None:
                        progress.update(1)
        elapsed = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    facts = [("model", engine.adapter_id), ("device", str(engine.device.device))]
    if args.plan:
        made = ", ".join(f"{n} {how}" for how, n in engine.stats().plans.items() if n)
        facts.append(("routing plans", made or "none"))
    _print_summary(results, elapsed, output, facts, note, sources_of, f"{modality}s")
    return 0 if all(r.ok for r in results) else 1


def _error_text(error: BaseException, sources: list[str]) -> str:
    """``Type: message (source: ...)``: the item the error concerns named by its source."""
    from aiomm.errors import AiommError

    message = error.message if isinstance(error, AiommError) else str(error)
    source = getattr(error, "source", None)
    if source is None:
        index = getattr(error, "item_index", None)
        if index is not None and 0 <= index < len(sources):
            source = sources[index]
        elif len(sources) == 1:
            source = sources[0]
    if source and f"(source: {source})" not in message:
        message = f"{message} (source: {source})"
    return f"{type(error).__name__}: {message}"


def _print_summary(
    results: list[Result],
    elapsed: float,
    output: Path,
    facts: list[tuple[str, str]],
    note: str | None,
    sources_of: dict[str, list[str]],
    items_name: str = "images",
) -> None:
    from aiomm.engine._stats import percentile

    ok = [r for r in results if r.ok]
    images = sum(len(r.cache) for r in ok)
    latencies = sorted(r.timings.get("total", 0.0) for r in ok)

    def latency(q: float) -> str:
        return f"{percentile(latencies, q) * 1000:.1f} ms" if latencies else "-"

    outcomes = [c.value for r in ok for c in r.cache]
    hits = sum(o in ("hit", "joined", "shared_hit", "shared_joined") for o in outcomes)
    rows = [
        *facts,
        ("requests", f"{len(results)} ({len(results) - len(ok)} failed)"),
        (items_name, str(images)),
        ("wall time", f"{elapsed:.2f} s"),
        (f"{items_name}/s", f"{images / elapsed:.1f}" if elapsed else "-"),
        ("requests/s", f"{len(results) / elapsed:.1f}" if elapsed else "-"),
        ("latency p50", latency(50)),
        ("latency p99", latency(99)),
        ("cache hit rate", f"{hits / len(outcomes):.0%}" if outcomes else "-"),
        ("results", str(output)),
    ]
    width = max(len(k) for k, _ in rows)
    print("aiomm run summary")
    if note:
        print(f"  ({note})")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    for r in results:
        if r.error is not None:
            shown = sources_of.get(str(r.request_id), [])
            print(f"  error {r.request_id}: {_error_text(r.error, shown)}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
