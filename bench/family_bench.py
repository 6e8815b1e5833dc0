"""The image processing path of each architecture: the HF processor, aiomm and vLLM side by side.

For each architecture (``--models``: short names; default every registered adapter), three
systems process the same seeded JPEG requests (1-3 images each, sizes from 320x240 to
1920x1080 and one 3840x2160), every request once per round: ``--warmup`` unmeasured rounds
each, then ``--rounds`` interleaved ABBA rounds (hf, aiomm, vllm, then vllm, aiomm, hf, ...), so
that the load of other processes falls on every system alike:

- ``hf``: the reference HF processor (``build_hf_processor(backend="torchvision")``) called as a
  server calls it: Pillow decode and ``convert("RGB")``, then ``processor(text=[prompt],
  images=..., return_tensors="pt")`` (CPU-normalised floats, its default), in a pool of
  ``--threads`` threads, each with its own copy of the processor (HF tokenizers are not
  thread-safe);
- ``aiomm``: what ``aiomm serve`` runs on the architecture's offline folder
  (``aiomm.adapters.folders.write_model_folder``): the render engine
  (``aiomm.server.render.render_engine``: vLLM's loading rule and mm_hashes) with
  :func:`aiomm.tuning.tuned`, ``return_items`` and the item cache off, ``Engine.stream`` with at
  most ``--concurrency`` requests in flight; decode, native transform and assembly, uint8 pixels
  where the architecture normalises on the device (a fresh engine per round, warmed by one small
  request first, so that no process-wide setting of it outlives its rounds);
- ``vllm`` (with ``--vllm-venv``): vLLM's processor on the same folder, run by
  ``bench/_vllm_worker.py --serve`` in that environment's interpreter, as its API server runs it:
  Pillow decode in a media pool of ``--threads`` threads, the prompt tokenized and
  ``BaseMultiModalProcessor.apply`` on the event loop with the processor cache off and vLLM's
  default ``mm_device_do_normalize``, at most ``--concurrency`` requests in flight.

An audio architecture (Qwen2-Audio, or with ``--audio`` one that takes both, the Omni thinkers)
gets clips instead of images: 1-2 per request, 2 to 30 s, WAV
(44.1 kHz stereo), MP3 (22.05 kHz) and FLAC (16 kHz); ``hf`` decodes them as vLLM's loader does
(:func:`aiomm.media.audio.decode_audio`, equal to it sample for sample) and calls the processor
with ``audio=``, ``sampling_rate`` and ``truncation=True`` as vLLM does; ``vllm`` loads them with
its ``AudioMediaIO`` and resamples in its data parser. Its table counts clips where it says
images.

The prompt of a request is the family's chat template (``aiomm.adapters.folders.CHAT_TEMPLATES``)
rendered by the processor's tokenizer, an image part and a word per image; a processor without
one gets its ``image_token`` per image. Every system uses ``--threads`` threads: its torch intra-op
threads and its thread pool alike (HF's pool, aiomm's ``transform_threads`` and
``torch_threads``, vLLM's media pool and ``OMP_NUM_THREADS``). CPU is the process CPU time of
the process that does the work (the worker's own for vLLM) over a round; images/s is a round's
images over its wall time, both summed over the rounds (the table also shows the median round's
CPU per image and the system CPU's share: page faults of fresh memory count there). A system
that fails to start or to finish a round is reported as failed, with the reason, and the others
go on.

    python bench/family_bench.py [--models qwen2-vl,mistral3] [--n 12] [--rounds 4] [--warmup 1]
        [--threads 2] [--concurrency 4] [--vllm-venv /tmp/vllm-venv] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import itertools
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import PIL.Image
import torch

from aiomm.adapters import AdapterInfo, get_adapter_info, supported_adapters
from aiomm.adapters.folders import CHAT_TEMPLATES, write_model_folder
from aiomm.config import EngineConfig
from aiomm.media.samples import encode, photo_like
from aiomm.server.render import render_engine
from aiomm.tuning import tuned
from aiomm.types import Request

BENCH = Path(__file__).resolve().parent
#: (width, height) of the images requests draw from
SIZES = ((320, 240), (640, 480), (1024, 768), (1280, 720), (1920, 1080))
#: one image of the workload has this size
LARGE = (3840, 2160)
TEXT = "describe the image"
SYSTEMS = ("hf", "aiomm", "vllm")
#: an audio architecture's clips: (soundfile format, subtype, rate, channels), and durations
CLIP_FORMATS = (("WAV", "PCM_16", 44100, 2), ("MP3", "MPEG_LAYER_III", 22050, 1),
                ("FLAC", "PCM_16", 16000, 1))  # fmt: skip
CLIP_SECONDS = (2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Workload:
    """Encoded images (or clips, ``modality="audio"``) and the requests that use them (indices
    into ``images``)."""

    images: tuple[bytes, ...]
    sizes: tuple[tuple[int, int], ...]
    requests: tuple[tuple[int, ...], ...]
    modality: str = "image"

    @property
    def image_count(self) -> int:
        return sum(len(r) for r in self.requests)


def make_workload(
    n: int, seed: int, sizes: Sequence[tuple[int, int]], large: tuple[int, int] | None
) -> Workload:
    """``n`` requests of 1-3 distinct JPEGs (quality 90) of ``sizes``; the middle image slot is
    ``large`` where given."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 4, size=n)
    drawn = [sizes[int(i)] for i in rng.integers(len(sizes), size=int(counts.sum()))]
    if large is not None:
        drawn[len(drawn) // 2] = large
    images = tuple(
        encode(photo_like(np.random.default_rng([seed, k]), h, w), "JPEG", quality=90)
        for k, (w, h) in enumerate(drawn)
    )
    bounds = [int(b) for b in np.cumsum([0, *counts])]
    requests = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))
    return Workload(images, tuple(drawn), requests)


def make_audio_workload(n: int, seed: int) -> Workload:
    """``n`` requests of 1-2 distinct clips of :data:`CLIP_FORMATS` and :data:`CLIP_SECONDS`
    (``sizes``: each clip's milliseconds and rate)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 3, size=n)
    clips, sizes = [], []
    for k in range(int(counts.sum())):
        fmt, subtype, rate, channels = CLIP_FORMATS[k % len(CLIP_FORMATS)]
        seconds = CLIP_SECONDS[int(rng.integers(len(CLIP_SECONDS)))]
        clips.append(_clip(seconds, rate, channels, fmt, subtype, seed=k))
        sizes.append((int(seconds * 1000), rate))
    bounds = [int(b) for b in np.cumsum([0, *counts])]
    requests = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))
    return Workload(tuple(clips), tuple(sizes), requests, modality="audio")


def _clip(seconds: float, rate: int, channels: int, fmt: str, subtype: str, seed: int) -> bytes:
    """A speech-like clip: a few harmonics under a syllable-rate envelope, a little noise."""
    import soundfile

    t = np.arange(round(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal((t.size, channels))
    voice = sum(np.sin(2 * np.pi * (120 + 7 * seed) * k * t) / k for k in range(1, 6))
    wave = 0.3 * (voice * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)))[:, None] + 0.01 * noise
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def warm_image() -> bytes:
    """A 128x96 JPEG for warm-up requests (not part of any measurement)."""
    return encode(photo_like(np.random.default_rng(7), 96, 128), "JPEG")


def warm_item(modality: str) -> bytes:
    """A warm-up item: :func:`warm_image`, or a second of audio."""
    if modality == "audio":
        return _clip(1.0, 16000, 1, "WAV", "PCM_16", seed=99)
    return warm_image()


def takes_audio_only(info: AdapterInfo) -> bool:
    """Whether the architecture takes audio and no images."""
    modalities = info.processor_cls.supported_modalities
    return "image" not in modalities and "audio" in modalities


def carries_audio(info: AdapterInfo, audio: bool) -> bool:
    """Whether the architecture's requests carry clips: it takes only audio, or it takes audio
    and ``--audio`` asks for clips (the Omni thinkers)."""
    return takes_audio_only(info) or (audio and "audio" in info.processor_cls.supported_modalities)


def render_prompts(hf: Any, counts: Sequence[int], modality: str = "image") -> dict[int, str]:
    """The prompt of a request with ``k`` images, for each ``k`` in ``counts``: the family's chat
    template rendered by the processor's tokenizer, else its ``image_token`` per image. A word
    follows each image (Gemma 3 refuses adjacent images: their placeholders overlap).

    :raises LookupError: the processor has neither a family chat template nor an ``image_token``.
    """
    template = CHAT_TEMPLATES.get(type(hf).__name__)
    tokenizer = getattr(hf, "tokenizer", None)
    out = {}
    for k in counts:
        if template is not None and tokenizer is not None:
            parts = []
            for i in range(k):
                words = TEXT if i == k - 1 else "and "
                parts += [{"type": modality}, {"type": "text", "text": words}]
            out[k] = tokenizer.apply_chat_template(
                [{"role": "user", "content": parts}],
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
            )
        elif isinstance(getattr(hf, "image_token", None), str):
            out[k] = f"{hf.image_token}and " * (k - 1) + hf.image_token + TEXT
        else:
            raise LookupError(
                f"{type(hf).__name__} has no chat template in CHAT_TEMPLATES and no image_token"
            )
    return out


def pil_rgb(data: bytes) -> PIL.Image.Image:
    """Encoded bytes decoded with Pillow and converted to RGB, as a server hands them to HF."""
    return PIL.Image.open(io.BytesIO(data)).convert("RGB")


class System(Protocol):
    """One system under test: ``start`` (warmed, unmeasured), ``run_round``, ``close``."""

    def start(self) -> dict[str, Any]: ...

    def run_round(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


Clock = tuple[float, float, float]


def clock() -> Clock:
    """Seconds now: wall, the process's CPU (user and system), and its system CPU alone."""
    return time.perf_counter(), time.process_time(), os.times().system


def _round_record(start: Clock, end: Clock, wl: Workload, tokens: int) -> dict[str, Any]:
    wall, cpu, system = (b - a for a, b in zip(start, end, strict=True))
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        # page faults of fresh memory show here (this VM backs memory again on first touch)
        "system_cpu_s": system,
        "requests": len(wl.requests),
        "images": wl.image_count,
        "prompt_tokens": tokens,
    }


def _dtype(value: Any) -> str:
    return str(value.dtype).removeprefix("torch.")


class HfSystem:
    """The reference HF processor in a thread pool, one processor copy per thread."""

    def __init__(
        self, info: AdapterInfo, wl: Workload, prompts: dict[int, str], threads: int
    ) -> None:
        self.info, self.wl, self.prompts, self.threads = info, wl, prompts, threads
        self._procs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> dict[str, Any]:
        base = self.info.build_hf_processor(backend="torchvision")
        for _ in range(self.threads):
            self._procs.put(copy.deepcopy(base))
        self._pool = ThreadPoolExecutor(
            self.threads, initializer=torch.set_num_threads, initargs=(self.threads,)
        )
        warm = [self._pool.submit(self._one, (-1,)) for _ in range(self.threads)]
        _, dtype = warm[0].result()
        return {"processor": type(base).__name__, "pixel_dtype": dtype,
                "torch_threads": self.threads, "pool_threads": self.threads}  # fmt: skip

    def _one(self, request: tuple[int, ...]) -> tuple[int, str]:
        """One request (``(-1,)``: the warm-up image): its prompt tokens and pixel dtype."""
        modality = self.wl.modality
        data = [warm_item(modality) if k < 0 else self.wl.images[k] for k in request]
        proc = self._procs.get()
        try:
            if modality == "audio":
                from aiomm.media.audio import decode_audio

                rate = proc.feature_extractor.sampling_rate
                out = proc(
                    text=[self.prompts[len(data)]],
                    audio=[decode_audio(d, target_rate=rate) for d in data],
                    sampling_rate=rate,
                    truncation=True,  # as vLLM calls it
                    return_tensors="pt",
                    add_special_tokens=False,
                )
                return len(out["input_ids"][0]), _dtype(out["input_features"])
            images = [pil_rgb(d) for d in data]
            out = proc(
                text=[self.prompts[len(images)]],
                images=images,
                return_tensors="pt",
                add_special_tokens=False,  # the rendered template holds them, as vLLM reads it
            )
        finally:
            self._procs.put(proc)
        return len(out["input_ids"][0]), _dtype(out["pixel_values"])

    def run_round(self) -> dict[str, Any]:
        assert self._pool is not None
        start = clock()
        done = list(self._pool.map(self._one, self.wl.requests))
        return _round_record(start, clock(), self.wl, sum(tokens for tokens, _ in done))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class AiommSystem:
    """``aiomm serve``'s render engine on the folder, the item cache off, a fresh one per round."""

    def __init__(
        self,
        name: str,
        folder: Path,
        wl: Workload,
        prompts: dict[int, str],
        threads: int,
        concurrency: int,
    ) -> None:
        self.name, self.folder, self.wl, self.prompts = name, folder, wl, prompts
        self.concurrency = concurrency
        self.config = tuned(
            EngineConfig(
                device="cpu",
                return_items=True,
                transform_threads=threads,
                torch_threads=threads,
                cache_capacity_bytes=0,
                max_in_flight=concurrency,
            )
        )

    def start(self) -> dict[str, Any]:
        engine = render_engine(self.folder, self.config, model_id=self.name)
        *_, dtype = asyncio.run(self._serve(engine, [(-1,)]))
        processor = engine.processor
        return {
            "processor": type(processor).__name__,
            "transform": processor.transform,
            "device_normalize": processor.device_normalize,
            "pixel_dtype": dtype,
            "transform_threads": self.config.transform_threads,
            "torch_threads": self.config.torch_threads,
        }

    async def _serve(
        self, engine: Any, requests: Sequence[tuple[int, ...]]
    ) -> tuple[Clock, Clock, int, str | None]:
        """Open ``engine``, warm it with one small request, then stream ``requests``: the clock
        before and after them (the warm-up left out), their prompt tokens, and the warm-up
        item's pixel dtype."""
        small = warm_item(self.wl.modality)
        field = "audios" if self.wl.modality == "audio" else "images"

        def request(index: int, images: tuple[int, ...]) -> Request:
            data = [small if k < 0 else self.wl.images[k] for k in images]
            prompt = self.prompts[len(data)]
            return Request(prompt=prompt, request_id=f"r{index}", **{field: data})

        async with engine:
            warm = await engine.process(request(-1, (-1,)))
            dtype = next(
                (
                    _dtype(v)
                    for k, v in warm.items[0].data.items()
                    if k.startswith(("pixel_values", "input_features"))
                ),
                None,
            )
            start = clock()
            tokens = 0
            reqs = [request(i, r) for i, r in enumerate(requests)]
            stream = engine.stream(reqs, ordered=False, max_in_flight=self.concurrency)
            async with stream as results:
                async for result in results:
                    if result.error is not None:
                        raise result.error
                    tokens += len(result.prompt_token_ids)
            end = clock()
        return start, end, tokens, dtype

    def run_round(self) -> dict[str, Any]:
        # built outside the clock: the processor is loaded from the folder, as a server starts
        engine = render_engine(self.folder, self.config, model_id=self.name)
        start, end, tokens, _ = asyncio.run(self._serve(engine, self.wl.requests))
        return _round_record(start, end, self.wl, tokens)

    def close(self) -> None:
        pass


class VllmSystem:
    """vLLM's processor in ``bench/_vllm_worker.py --serve``, a persistent worker process."""

    def __init__(
        self,
        python: str,
        folder: Path,
        wl: Workload,
        prompts: dict[int, str],
        threads: int,
        concurrency: int,
        scratch: Path,
    ) -> None:
        self.log = scratch / "vllm_worker.log"
        images = scratch / "images"
        images.mkdir(exist_ok=True)
        paths = []
        for k, data in enumerate(wl.images):
            path = images / f"{k}.jpg"
            if not path.is_file():
                path.write_bytes(data)
            paths.append(str(path))
        self.job = {
            "model_dir": str(folder),
            "modality": wl.modality,
            "images": paths,
            "requests": [{"prompt": prompts[len(r)], "images": list(r)} for r in wl.requests],
            "threads": threads,
            "concurrency": concurrency,
        }
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env.pop("PYTHONPATH", None)  # this environment's packages stay out of vLLM's
        self._sink = self.log.open("w")
        # started here, so that vLLM imports while the other systems are built
        self._proc = subprocess.Popen(
            [python, str(BENCH / "_vllm_worker.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._sink,
            text=True,
            env=env,
        )

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: its reply line is empty
        line = stdout.readline()
        if not line:
            self._proc.wait()
            tail = self.log.read_text()[-2000:]
            raise RuntimeError(f"vLLM worker exited {self._proc.returncode}: {tail}")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("status") == "failed":
            raise RuntimeError(f"{reply['reason']}\n{reply.get('traceback', '')}")
        return reply

    def start(self) -> dict[str, Any]:
        ready = self._ask(self.job)
        ready.pop("status")
        return ready

    def run_round(self) -> dict[str, Any]:
        reply = self._ask({"op": "round"})
        reply.pop("status")
        return reply

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                stdin = self._proc.stdin
                assert stdin is not None
                stdin.write(json.dumps({"op": "quit"}) + "\n")
                stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._sink.close()


def abba(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the systems in each round: forwards, backwards, forwards, ..."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Images/s and CPU ms per image over every round, the median round's CPU ms per image (a
    round that met a burst of page faults or another process's load weighs less there), the
    system CPU's share, and each round's images/s."""
    images = sum(r["images"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    cpu = sum(r["cpu_s"] for r in records)
    return {
        "images_per_s": images / wall,
        "cpu_ms_per_image": 1000 * cpu / images,
        "cpu_ms_per_image_median": statistics.median(
            1000 * r["cpu_s"] / r["images"] for r in records
        ),
        "system_cpu_share": sum(r.get("system_cpu_s", 0.0) for r in records) / cpu if cpu else 0.0,
        "round_images_per_s": [r["images"] / r["wall_s"] for r in records],
        "images": images,
        "prompt_tokens": records[-1]["prompt_tokens"],
    }


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """aiomm's CPU per image (over all rounds, and of the median rounds) and images/s over each
    other measured system's."""
    ours = systems.get("aiomm", {})
    if ours.get("status") != "ok":
        return {}
    out = {}
    for other in ("hf", "vllm"):
        theirs = systems.get(other, {})
        if theirs.get("status") == "ok":
            out[f"cpu_per_image_aiomm_over_{other}"] = (
                ours["cpu_ms_per_image"] / theirs["cpu_ms_per_image"]
            )
            out[f"cpu_per_image_median_aiomm_over_{other}"] = (
                ours["cpu_ms_per_image_median"] / theirs["cpu_ms_per_image_median"]
            )
            out[f"images_per_s_aiomm_over_{other}"] = ours["images_per_s"] / theirs["images_per_s"]
    return out


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}".strip()[:2000],
            "traceback": traceback.format_exc()[-3000:]}  # fmt: skip


def run_architecture(
    name: str, wl: Workload, args: argparse.Namespace, scratch: Path
) -> dict[str, Any]:
    """Every system's rounds on ``wl`` for architecture ``name``: the architecture's record."""
    info = get_adapter_info(name)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    record: dict[str, Any] = {"architecture": info.architecture, "systems": {}}
    out: dict[str, dict[str, Any]] = record["systems"]
    folder = scratch / "model"
    live: dict[str, System] = {}
    try:
        hf_reference = info.build_hf_processor(backend="torchvision")
        counts = sorted({len(r) for r in wl.requests} | {1})
        prompts = render_prompts(hf_reference, counts, wl.modality)
        record["prompt_1_image"] = prompts[1]
        write_model_folder(name, folder)
    except Exception as exc:
        record.update(_failure(exc))
        return record
    candidates: dict[str, Any] = {}
    if "vllm" in args.systems:
        if args.vllm_venv is None:
            out["vllm"] = {"status": "skipped", "reason": "no --vllm-venv given"}
        else:
            python = str(Path(args.vllm_venv) / "bin" / "python")
            candidates["vllm"] = lambda: VllmSystem(
                python, folder, wl, prompts, args.threads, args.concurrency, scratch
            )
    candidates["hf"] = lambda: HfSystem(info, wl, prompts, args.threads)
    candidates["aiomm"] = lambda: AiommSystem(
        info.short_name, folder, wl, prompts, args.threads, args.concurrency
    )
    try:
        for system in ("vllm", "hf", "aiomm"):  # vLLM first: its worker imports meanwhile
            if system in candidates and system in args.systems:
                try:
                    live[system] = candidates[system]()
                except Exception as exc:
                    out[system] = _failure(exc)
        for system in SYSTEMS:
            if system in live:
                try:
                    out[system] = {"status": "ok", **live[system].start()}
                except Exception as exc:
                    out[system] = _failure(exc)
                    live.pop(system).close()
        print(f"  {name}: started {', '.join(live) or 'nothing'} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)  # fmt: skip
        rounds: dict[str, list[dict[str, Any]]] = {system: [] for system in live}
        warmups: dict[str, list[dict[str, Any]]] = {system: [] for system in live}
        started = [s for s in SYSTEMS if s in live]
        # unmeasured rounds first: this VM backs memory again on first touch, which slows the
        # first round of whichever system first holds large buffers (once ten times over)
        schedule: list[tuple[int | None, list[str]]] = [(None, started)] * args.warmup
        schedule += list(enumerate(abba(started, args.rounds)))
        for r, order in schedule:
            for system in order:
                if system not in live:
                    continue  # failed in an earlier round
                try:
                    rec = live[system].run_round()
                except Exception as exc:
                    out[system] = _failure(exc)
                    live.pop(system).close()
                    continue
                (warmups if r is None else rounds)[system].append(rec)
                label = "warm-up round" if r is None else f"round {r + 1}/{args.rounds}"
                print(f"  {name} {label} {system}: "
                      f"{rec['images'] / rec['wall_s']:.2f} images/s", file=sys.stderr)  # fmt: skip
        for system, recs in rounds.items():
            if system in live and recs:
                out[system].update(summarise(recs), rounds=recs, warmup_rounds=warmups[system])
    finally:
        for system in list(live):
            live.pop(system).close()
    record["ratios"] = ratios(out)
    record["load_average"] = {"before": load_before, "after": os.getloadavg()}
    record["elapsed_s"] = time.perf_counter() - t0
    return record


def table_lines(
    name: str, record: dict[str, Any], wl: Workload, args: argparse.Namespace
) -> list[str]:
    """The printed table of one architecture: a row per system, then aiomm's ratios."""
    lines = [
        f"{name} ({record['architecture']}): {len(wl.requests)} requests, {wl.image_count} "
        f"images/round, {args.warmup} warm-up + {args.rounds} ABBA rounds, {args.threads} "
        f"threads each (torch and pool), concurrency {args.concurrency}; load average "
        + (
            f"{record['load_average']['before'][0]:.2f} -> {record['load_average']['after'][0]:.2f}"
            if "load_average" in record
            else "n/a"
        )
    ]
    if record.get("status") == "failed":
        return [*lines, f"  failed: {record['reason']}"]
    lines.append(f"{'system':8s} {'images/s':>9s} {'CPU ms/img':>11s} {'median':>7s} "
                 f"{'sys':>4s} {'pixels':>8s} {'tokens':>8s}  images/s per round")  # fmt: skip
    for system in SYSTEMS:
        rec = record["systems"].get(system)
        if rec is None:
            continue
        if rec["status"] != "ok" or "images_per_s" not in rec:
            reason = rec.get("reason", "no round finished").splitlines()[0][:140]
            lines.append(f"{system:8s} {rec['status']}: {reason}")
            continue
        per_round = " ".join(f"{x:.2f}" for x in rec["round_images_per_s"])
        lines.append(
            f"{system:8s} {rec['images_per_s']:9.2f} {rec['cpu_ms_per_image']:11.1f} "
            f"{rec['cpu_ms_per_image_median']:7.1f} {rec['system_cpu_share']:4.0%} "
            f"{rec.get('pixel_dtype')!s:>8s} {rec['prompt_tokens']:8d}  {per_round}"
        )
    r = record.get("ratios", {})
    shown = [
        f"aiomm/{other} CPU per image x{r[f'cpu_per_image_aiomm_over_{other}']:.2f} "
        f"(median rounds x{r[f'cpu_per_image_median_aiomm_over_{other}']:.2f}; "
        f"images/s x{r[f'images_per_s_aiomm_over_{other}']:.2f})"
        for other in ("hf", "vllm")
        if f"cpu_per_image_aiomm_over_{other}" in r
    ]
    lines.append(
        "; ".join(shown) if shown else "no ratio: aiomm and another system not both measured"
    )
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    """Every architecture in one Markdown table: images/s (CPU ms per image) of each system,
    and aiomm's CPU per image over HF's and vLLM's."""

    def cell(rec: dict[str, Any] | None) -> str:
        if rec is None:
            return "-"
        if "images_per_s" not in rec:
            return str(rec.get("status", "-"))
        return f"{rec['images_per_s']:.2f} ({rec['cpu_ms_per_image']:.1f})"

    lines = [
        "| architecture | hf images/s (CPU ms/img) | aiomm | vllm | aiomm/hf CPU per image "
        "| aiomm/vllm CPU per image |",
        "|---|---|---|---|---|---|",
    ]
    for name, record in report["architectures"].items():
        systems, r = record.get("systems", {}), record.get("ratios", {})
        ratio = [r.get(f"cpu_per_image_aiomm_over_{other}") for other in ("hf", "vllm")]
        cells = [cell(systems.get(system)) for system in SYSTEMS]
        cells += ["-" if x is None else f"{x:.2f}" for x in ratio]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _size(text: str) -> tuple[int, int]:
    width, height = text.lower().split("x")
    return int(width), int(height)


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(BENCH.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated short names (default: every registered adapter)",
    )
    parser.add_argument("--n", type=int, default=12, help="requests per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per system (ABBA order)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured rounds per system before the measured ones",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="threads of every system: torch intra-op and its pool",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sizes",
        default=",".join(f"{w}x{h}" for w, h in SIZES),
        help="WxH,... the requests' images are drawn from",
    )
    parser.add_argument(
        "--large",
        default="x".join(map(str, LARGE)),
        help="WxH of the one large image ('none': no large image)",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--vllm-venv",
        default=None,
        help="a virtual environment with vllm 0.33 (its bin/python runs the "
        "worker); without it the vllm system is skipped",
    )
    parser.add_argument(
        "--audio",
        action="store_true",
        help="clips instead of images for every architecture that takes audio",
    )
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)  # fmt: skip
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if min(args.n, args.rounds, args.threads, args.concurrency) < 1:
        parser.error("--n, --rounds, --threads and --concurrency must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    args.sizes = [_size(s) for s in args.sizes.split(",") if s]
    args.large = None if args.large.lower() == "none" else _size(args.large)
    if args.models is None:
        args.models = [info.short_name for info in supported_adapters()]
    else:
        args.models = [get_adapter_info(m).short_name for m in args.models.split(",") if m]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    wl = make_workload(args.n, args.seed, args.sizes, args.large)
    audio_wl = None
    if any(carries_audio(get_adapter_info(name), args.audio) for name in args.models):
        audio_wl = make_audio_workload(args.n, args.seed)
    report: dict[str, Any] = {
        "settings": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "threads": args.threads,
            "concurrency": args.concurrency,
            "requests": args.n,
            "images_per_round": wl.image_count,
            "image_sizes": [f"{w}x{h}" for w, h in wl.sizes],
            "jpeg_bytes": sum(len(d) for d in wl.images),
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "seed": args.seed,
            "systems": args.systems,
            "vllm_venv": args.vllm_venv,
            # (milliseconds, rate) of each clip of an audio architecture's workload
            "audio_clips": None if audio_wl is None else [list(s) for s in audio_wl.sizes],
        },
        "architectures": {},
    }
    with tempfile.TemporaryDirectory(prefix="family-bench-") as tmp:
        for name in args.models:
            scratch = Path(tmp) / name
            scratch.mkdir()
            own = audio_wl if carries_audio(get_adapter_info(name), args.audio) else wl
            assert own is not None
            record = run_architecture(name, own, args, scratch)
            report["architectures"][name] = record
            table = table_lines(name, record, own, args)
            print("\n".join(table) + "\n", flush=True)
            if args.json:  # after each architecture: a long run keeps what it measured
                Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(summary_lines(report)), flush=True)
    return report


if __name__ == "__main__":
    main()
