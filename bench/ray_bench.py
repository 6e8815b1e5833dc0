"""Ray Data preprocessing: aiomm's ``ImagePreprocessor`` vs ``map_batches`` running the HF
processor (the way users do it today), on the same local Ray cluster and the same rows.

Each system is one ``map_batches`` stage over the same in-memory rows (photo-like JPEGs with a
Qwen2-VL prompt), with the same actor pool and CPUs per actor, and the driver consumes the
output. ``hf`` holds the reference HF processor in each actor and calls it row by row, as vLLM's
``ray.data.llm`` preprocessing stage does (PIL decode, then the processor: float32 pixels);
``aiomm-uint8`` is ``ImagePreprocessor`` (uint8 rows, normalised later on the device);
``aiomm-norm`` is ``ImagePreprocessor(normalize=True)`` with ``visual_dtype="float32"`` (the same
float32 pixels as HF, bit for bit). Each system runs a one-batch job and the full job;
throughput is the difference of their images over the difference of their wall times, so actor
start-up (building a processor, paid once by a long job) is left out of every system alike. The
ratios are printed last::

    python bench/ray_bench.py [--images 96] [--actors 1] [--cpus-per-actor 2] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from typing import Any

import numpy as np
import PIL.Image
import ray

from aiomm.adapters import get_adapter_info
from aiomm.config import EngineConfig
from aiomm.integrations.ray import ImagePreprocessor
from aiomm.media.samples import encode, photo_like

PROMPT = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|> describe<|im_end|>"
SIZES = [(480, 640), (600, 800), (768, 1024), (960, 1280), (720, 540), (1080, 1440)]


class HFPreprocessor:
    """What users run today: the HF processor in each actor, one row at a time."""

    def __init__(self, model: str) -> None:
        self.processor = get_adapter_info(model).build_hf_processor(backend="torchvision")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        ids, pixels, grids = [], [], []
        for data, text in zip(batch["image"], batch["prompt"], strict=True):
            image = PIL.Image.open(io.BytesIO(data)).convert("RGB")
            out = self.processor(text=[str(text)], images=[image], return_tensors="pt")
            ids.append(out["input_ids"][0].numpy())
            pixels.append(out["pixel_values"].numpy())
            grids.append(out["image_grid_thw"].numpy())
        return {
            "prompt_token_ids": _objects(ids),
            "pixel_values": _objects(pixels),
            "image_grid_thw": _objects(grids),
        }


def _objects(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    out[:] = arrays
    return out


def rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {"image": encode(photo_like(rng, *SIZES[i % len(SIZES)]), "JPEG"), "prompt": PROMPT}
        for i in range(n)
    ]


def run(ds: ray.data.Dataset, udf: Any, kwargs: dict[str, Any], args: argparse.Namespace) -> dict:
    """Wall seconds of one job over ``ds`` (actor start-up included) and its error count."""
    out = ds.map_batches(
        udf,
        fn_constructor_kwargs=kwargs,
        compute=ray.data.ActorPoolStrategy(size=args.actors),
        num_cpus=args.cpus_per_actor,
        batch_size=args.batch_size,
    )
    t0 = time.perf_counter()
    images = errors = 0
    for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
        images += len(batch["pixel_values"])
        if "error" in batch:
            errors += sum(e is not None for e in batch["error"])
    return {"images": images, "errors": errors, "wall_s": time.perf_counter() - t0}


def measure(
    small: ray.data.Dataset, big: ray.data.Dataset, udf: Any, kwargs: dict[str, Any], args: Any
) -> dict:
    """Images/s of the big job beyond the small one: the difference leaves out actor start-up
    (building a processor), which a long job pays once."""
    a, b = run(small, udf, kwargs, args), run(big, udf, kwargs, args)
    rate = (b["images"] - a["images"]) / max(b["wall_s"] - a["wall_s"], 1e-9)
    return {**b, "startup_job_s": a["wall_s"], "images_per_s": rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--cpus-per-actor", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default="qwen2-vl")
    args = parser.parse_args()

    here = os.getcwd()
    with tempfile.TemporaryDirectory() as empty:
        # ray.init puts the working directory on every worker's sys.path; a checkout's top-level
        # kernels/ there would shadow the Hugging Face `kernels` package
        os.chdir(empty)
        try:
            ray.init(
                num_cpus=args.actors * args.cpus_per_actor,
                include_dashboard=False,
                log_to_driver=False,
            )
        finally:
            os.chdir(here)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            all_rows = rows(args.images)
            small = ray.data.from_items(all_rows[: args.batch_size]).materialize()
            big = ray.data.from_items(all_rows).materialize()
            config = EngineConfig(device="cpu", transform_threads=args.cpus_per_actor)
            systems = {
                "hf": (HFPreprocessor, {"model": args.model}),
                "aiomm-uint8": (ImagePreprocessor, {"model": args.model, "config": config}),
                "aiomm-norm": (
                    ImagePreprocessor,
                    {
                        "model": args.model,
                        "config": EngineConfig(
                            device="cpu",
                            transform_threads=args.cpus_per_actor,
                            visual_dtype="float32",
                        ),
                        "normalize": True,
                    },
                ),
            }
            results = {
                name: measure(small, big, udf, kw, args) for name, (udf, kw) in systems.items()
            }
        finally:
            ray.shutdown()

    print(
        f"\n{args.images} images ({len(SIZES)} sizes, 0.3-1.6 MP JPEG), {args.actors} actor(s) x "
        f"{args.cpus_per_actor} CPUs, batch_size {args.batch_size}, model {args.model}"
    )
    print(f"{'system':<14}{'images':>8}{'errors':>8}{'1-batch s':>11}{'wall s':>9}{'images/s':>10}")
    for name, r in results.items():
        print(
            f"{name:<14}{r['images']:>8}{r['errors']:>8}{r['startup_job_s']:>11.2f}"
            f"{r['wall_s']:>9.2f}{r['images_per_s']:>10.1f}"
        )
    base = results["hf"]["images_per_s"]
    for name in ("aiomm-uint8", "aiomm-norm"):
        print(f"ratio {name} / hf: {results[name]['images_per_s'] / base:.2f}x")


if __name__ == "__main__":
    main()
