"""vLLM's own processing path on a benchmark's workload; runs inside a vLLM venv.

``aiomm bench --vllm-python PATH`` (Qwen2-VL) starts ``PATH bench/_vllm_worker.py JOB.json
RESULT.json``. The worker reads the same workload files and serves them as vLLM 0.33's API server
does in one process: each image decoded with Pillow in a media thread pool
(``VLLM_MEDIA_LOADING_THREAD_COUNT`` workers, 8 by default), then the prompt tokenized and
``BaseMultiModalProcessor.apply`` run with the processor cache on the event loop, inside
``set_default_torch_num_threads()`` (as ``vllm/renderers/base.py::_process_multimodal`` does).
Its closed and open loops are those of ``stream_bench.loadgen`` (standard library and numpy
only), so both sides are measured the same way; it writes the timings as JSON.

Only vllm's public processor API is called (as ``../shared/vllm_probe`` does); this file imports
nothing but vllm, the standard library, Pillow, numpy and ``stream_bench``'s workload and load
generator. The model folder (a weight-less Qwen2-VL config with aiomm's offline reference
processor and tokenizer) is written by ``stream_bench.systems.vllm``, so both run the same
transform parameters.

``PATH bench/_vllm_worker.py --serve`` is the persistent form ``bench/family_bench.py`` drives,
for any architecture's folder: it reads a job (the folder, the image files, the requests with
their rendered prompts, the thread and concurrency settings) as the first JSON line of stdin,
builds the processor with the cache off and answers one JSON line on its own stdout when ready;
then each ``{"op": "round"}`` line runs every request once (decode in the media pool, tokenize,
``apply`` on the event loop, at most ``concurrency`` requests in flight) and answers the round's
wall and process CPU seconds, until ``{"op": "quit"}`` or the end of stdin. Everything else the
process prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Offline, CPU only, quiet: set before vllm is imported.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent))
# standard library and numpy only at import time: this environment has no aiomm
from stream_bench.loadgen import Done, TaskServer, drive, json_safe  # noqa: E402
from stream_bench.measure import Meter  # noqa: E402
from stream_bench.workload import (  # noqa: E402
    WorkRequest,
    arrive,
    ids_sha,
    load_workload,
    prompt_for,
)


def _sha(tensor: Any) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def run(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from PIL import Image
    from vllm import __version__ as vllm_version
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.cache import LruKeyReplicatedSenderCache, MultiModalProcessorOnlyCache
    from vllm.multimodal.processing import ProcessorInputs, TimingContext
    from vllm.utils.torch_utils import set_default_torch_num_threads

    wl = load_workload(Path(job["workload"]))
    folder = job["model_dir"]
    config = ModelConfig(
        model=folder,
        tokenizer=folder,
        dtype="bfloat16",
        max_model_len=32768,
        mm_processor_cache_gb=4.0,
    )
    with set_default_torch_num_threads():
        processor = MULTIMODAL_REGISTRY.create_processor(config)
    tokenizer = processor.info.get_tokenizer()
    cache_cls = {
        "lru": LruKeyReplicatedSenderCache,
        "processor_only": MultiModalProcessorOnlyCache,
    }.get(job["vllm_cache"])
    pool = ThreadPoolExecutor(job["media_threads"], thread_name_prefix="media")

    def decode(data: bytes) -> Any:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")

    def apply(prompt: str, images: list[Any], cache: Any) -> Any:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with set_default_torch_num_threads():
            items = processor.info.parse_mm_data({"image": images})
            inputs = ProcessorInputs(ids, items, None, hf_processor_mm_kwargs={}, cache=cache)
            return processor.apply(inputs, TimingContext())

    class Server(TaskServer):
        def __init__(self) -> None:
            self.cache = cache_cls(config) if cache_cls is not None else None
            super().__init__(lambda index: arrive(wl, index), self.handle)

        async def handle(self, req: WorkRequest) -> Done:
            loop = asyncio.get_running_loop()
            images = await asyncio.gather(
                *(loop.run_in_executor(pool, decode, data) for data in req.images)
            )
            apply(req.prompt, list(images), self.cache)  # on the event loop, as vLLM does
            return Done(time.perf_counter(), images=len(images))

        def extra(self, meter: Meter) -> dict[str, Any]:
            if self.cache is None:
                return {}
            stats = self.cache.make_stats()
            return {"cache_hits": int(stats.hits), "cache_lookups": int(stats.total)}

    ramp = np.linspace(0, 255, 96 * 128 * 3).reshape(96, 128, 3).astype(np.uint8)
    warm = prompt_for(1, "describe")
    apply(warm, [Image.fromarray(ramp)], None)

    out = drive(job, Server, len(wl.requests))
    # set_default_torch_num_threads(): $OMP_NUM_THREADS, else 1
    out["settings"] = {
        "vllm": vllm_version,
        "cache": job["vllm_cache"],
        "media_threads": job["media_threads"],
        "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
    }
    rows = []
    for i in job["exact_requests"]:
        req = wl.requests[i]
        result = apply(req.prompt, [decode(wl.data[k]) for k in req.images], None)
        items = result["mm_kwargs"]["image"]
        rows.append(
            {
                "request": i,
                "image_sha": [_sha(item["pixel_values"].data) for item in items],
                "dtype": str(items[0]["pixel_values"].data.dtype) if items else None,
                "prompt_token_ids_sha": ids_sha(result["prompt_token_ids"]),
                "placeholders": [r.length for r in result["mm_placeholders"]["image"]],
            }
        )
    out["exact"] = rows
    pool.shutdown()
    return out


class _Rounds:
    """vLLM's processor for one model folder with the cache off, and the job's requests."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import __version__ as vllm_version
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.processing import ProcessorInputs, TimingContext
        from vllm.utils.torch_utils import set_default_torch_num_threads

        t0 = time.perf_counter()
        folder = job["model_dir"]
        # the render server's settings but the cache: vLLM's default mm_device_do_normalize
        config = ModelConfig(
            model=folder,
            tokenizer=folder,
            dtype="bfloat16",
            max_model_len=32768,
            mm_processor_cache_gb=0,
        )
        with set_default_torch_num_threads():
            processor = MULTIMODAL_REGISTRY.create_processor(config)
        tokenizer = processor.info.get_tokenizer()

        # an audio architecture's items are clips (``"images"`` then names the clip files)
        modality = job.get("modality", "image")
        # a model taking images and videos as one modality (Kimi-K2.5): its chat parser's items
        chunks = modality == "image" and "vision_chunk" in processor.info.supported_mm_limits
        if chunks:
            modality = "vision_chunk"

        def apply(prompt: str, images: list[Any]) -> Any:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            if chunks:
                images = [{"type": "image", "image": im, "uuid": None} for im in images]
            with set_default_torch_num_threads():
                items = processor.info.parse_mm_data({modality: images})
                inputs = ProcessorInputs(ids, items, None, hf_processor_mm_kwargs={}, cache=None)
                return processor.apply(inputs, TimingContext())

        self.decode = _decode_audio if modality == "audio" else _decode
        self.apply = apply
        self.data = [Path(path).read_bytes() for path in job["images"]]
        self.requests: list[dict[str, Any]] = job["requests"]
        self.concurrency = int(job["concurrency"])
        self.pool = ThreadPoolExecutor(int(job["threads"]), thread_name_prefix="media")
        warm = self.requests[0]
        result = apply(warm["prompt"], [self.decode(self.data[k]) for k in warm["images"]])
        mm_config = config.multimodal_config
        self.ready = {
            "status": "ready",
            "vllm": vllm_version,
            "processor": type(processor).__name__,
            # set_default_torch_num_threads(): $OMP_NUM_THREADS, else 1
            "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
            "media_threads": int(job["threads"]),
            "mm_device_do_normalize": getattr(mm_config, "mm_device_do_normalize", None),
            "pixel_dtype": _pixel_dtype(result),
            "setup_s": time.perf_counter() - t0,
        }

    def run(self) -> dict[str, Any]:
        """Every request once: the wall and process CPU seconds, images and prompt tokens."""
        gate = asyncio.Semaphore(self.concurrency)

        async def one(req: dict[str, Any]) -> int:
            async with gate:
                loop = asyncio.get_running_loop()
                images = await asyncio.gather(
                    *(
                        loop.run_in_executor(self.pool, self.decode, self.data[k])
                        for k in req["images"]
                    )
                )
                # on the event loop, as vLLM's renderer runs it
                return len(self.apply(req["prompt"], list(images))["prompt_token_ids"])

        async def all_requests() -> dict[str, Any]:
            c0, w0, s0 = time.process_time(), time.perf_counter(), os.times().system
            tokens = await asyncio.gather(*(one(req) for req in self.requests))
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            return {
                "status": "ok",
                "wall_s": wall,
                "cpu_s": cpu,
                "system_cpu_s": os.times().system - s0,
                "requests": len(self.requests),
                "images": sum(len(req["images"]) for req in self.requests),
                "prompt_tokens": sum(tokens),
            }

        return asyncio.run(all_requests())


def _decode(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def _decode_audio(data: bytes) -> Any:
    """A clip as vLLM's render server loads it: ``(samples, rate)`` at its native rate (its data
    parser resamples)."""
    from vllm.multimodal.media.audio import AudioMediaIO

    return AudioMediaIO().load_bytes(data)


def _pixel_dtype(result: Any) -> str | None:
    """The dtype of the first item's pixel (or audio feature) tensor in a processor output
    (None: none)."""
    mm_kwargs = result["mm_kwargs"]
    firsts = ("image", "vision_chunk", "audio")
    for item in [item for m in firsts for item in mm_kwargs.get(m, [])[:1]]:
        for key, elem in item.items():
            if key.startswith(("pixel_values", "input_features")):
                return str(elem.data.dtype).removeprefix("torch.")
    return None


def _failed(exc: BaseException) -> dict[str, Any]:
    return {
        "status": "failed",
        "reason": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc()[-4000:],
    }


def serve() -> int:
    """The persistent mode: one job from stdin, then rounds until ``quit`` (module docstring)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever vLLM or transformers print goes to stderr, never into the replies

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(json_safe(message)) + "\n")
        replies.flush()

    try:
        rounds = _Rounds(json.loads(sys.stdin.readline()))
    except Exception as exc:
        reply(_failed(exc))
        return 0
    reply(rounds.ready)
    for line in sys.stdin:
        op = json.loads(line).get("op")
        if op == "quit":
            break
        try:
            reply(rounds.run() if op == "round" else {"status": "failed", "reason": f"op {op!r}"})
        except Exception as exc:
            reply(_failed(exc))
    rounds.pool.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    job_path, result_path = argv
    job = json.loads(Path(job_path).read_text())
    try:
        result = run(job)
    except Exception as exc:
        result = {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(result_path).write_text(json.dumps(json_safe(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
