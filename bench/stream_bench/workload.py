"""The seeded workload: encoded images on disk and the requests that use them.

Standard library and numpy at import time: the vLLM worker loads the workload with this module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .measure import cores

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TEXTS = (
    "describe the image",
    "what is in this picture",
    "tell me about the photo",
    "look at the image and describe the colours and shapes",
)
#: (width, height, weight); PNG only up to PNG_MAX_PIXELS (screenshots), photos are JPEG
FULL_SIZES = (
    (640, 480, 0.18),
    (1024, 768, 0.15),
    (1280, 720, 0.15),
    (1920, 1080, 0.2),
    (2048, 1536, 0.1),
    (2560, 1440, 0.08),
    (4032, 3024, 0.09),
    (3024, 4032, 0.05),
)
QUICK_SIZES = ((640, 480, 0.5), (800, 600, 0.3), (1280, 720, 0.2))
PNG_MAX_PIXELS = 2560 * 1440


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything the generated workload depends on; its hash names the cache folder."""

    seed: int = 0
    requests: int = 240
    repeat_share: float = 0.25
    zipf_s: float = 1.1
    max_images: int = 4
    png_share: float = 0.25
    sizes: tuple[tuple[int, int, float], ...] = FULL_SIZES

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class WorkRequest:
    prompt: str
    #: indices into ``Workload.data``, or (once arrived) the encoded bytes themselves
    images: list[Any]


@dataclass
class Workload:
    folder: Path
    manifest: dict[str, Any]
    data: list[bytes]
    requests: list[WorkRequest]


def ids_sha(ids: Sequence[int]) -> str:
    """A short digest of a token id list (compared across processes)."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def arrive(wl: Workload, index: int) -> WorkRequest:
    """Request ``index`` as it arrives at a server: its own copy of each image's bytes."""
    req = wl.requests[index]
    return WorkRequest(req.prompt, [bytes(memoryview(wl.data[k])) for k in req.images])


def prompt_for(n_images: int, text: str) -> str:
    """A Qwen2-VL chat prompt with one placeholder per image."""
    return f"<|im_start|>user\n{PLACEHOLDER * n_images}{text}<|im_end|>\n<|im_start|>assistant\n"


def load_workload(folder: Path) -> Workload:
    """The workload :func:`ensure_workload` wrote to ``folder``, images read into memory."""
    manifest = json.loads((folder / "manifest.json").read_text())
    data = [(folder / img["file"]).read_bytes() for img in manifest["images"]]
    requests = [WorkRequest(r["prompt"], list(r["images"])) for r in manifest["requests"]]
    return Workload(folder, manifest, data, requests)


def _make_image(seed: int, k: int, img: dict[str, Any], folder: Path) -> int:
    # imported here: only the parent generates images, the vLLM environment has no aiomm
    from aiomm.media.samples import encode, photo_like

    rng = np.random.default_rng([seed, k])
    data = encode(photo_like(rng, img["height"], img["width"]), img["format"])
    (folder / img["file"]).write_bytes(data)
    return len(data)


def ensure_workload(spec: WorkloadSpec, root: Path) -> Path:
    """Generate (once per spec; cached under ``root``) the images and the request manifest.

    Of all image slots, ``repeat_share`` repeat an earlier image; which one follows a Zipf law
    over the unique images (a few are very popular).
    """
    folder = root / f"{len(spec.sizes)}s-{spec.requests}r-{spec.key()}"
    if (folder / "manifest.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    counts = rng.integers(1, spec.max_images + 1, size=spec.requests)
    slots = int(counts.sum())
    unique = max(1, round(slots * (1 - spec.repeat_share)))
    popularity = 1.0 / np.arange(1, unique + 1) ** spec.zipf_s
    repeats = rng.choice(unique, size=slots - unique, p=popularity / popularity.sum())
    order = np.concatenate([np.arange(unique), repeats])
    rng.shuffle(order)
    weights = np.array([w for _, _, w in spec.sizes])
    picks = rng.choice(len(spec.sizes), size=unique, p=weights / weights.sum())
    images = []
    for k, pick in enumerate(picks):
        width, height, _ = spec.sizes[pick]
        png = width * height <= PNG_MAX_PIXELS and rng.random() < spec.png_share
        fmt = "PNG" if png else "JPEG"
        images.append(
            {
                "file": f"img_{k:05d}.{'png' if png else 'jpg'}",
                "width": width,
                "height": height,
                "format": fmt,
            }
        )
    # numpy and Pillow's encoders release the GIL: threads use every core
    with ThreadPoolExecutor(cores()) as pool:
        sizes = pool.map(lambda a: _make_image(spec.seed, *a, folder), enumerate(images))
        for img, nbytes in zip(images, sizes, strict=True):
            img["bytes"] = nbytes
    requests, pos = [], 0
    for c in counts:
        ids = [int(i) for i in order[pos : pos + c]]
        pos += c
        text = TEXTS[int(rng.integers(len(TEXTS)))]
        requests.append({"prompt": prompt_for(len(ids), text), "images": ids})
    manifest = {
        "spec": asdict(spec),
        "images": images,
        "requests": requests,
        "slots": slots,
        "unique": unique,
    }
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.replace(folder / "manifest.json")
    return folder


def describe_workload(wl: Workload, n: int) -> dict[str, Any]:
    """Counts, repeat share, formats, mean megapixels and encoded size of the first ``n``."""
    reqs = wl.requests[:n]
    ids = [k for r in reqs for k in r.images]
    fmts = [wl.manifest["images"][k]["format"] for k in set(ids)]
    px = [wl.manifest["images"][k]["width"] * wl.manifest["images"][k]["height"] for k in ids]
    return {
        "requests": len(reqs),
        "images": len(ids),
        "unique_images": len(set(ids)),
        "repeat_share": 1 - len(set(ids)) / max(1, len(ids)),
        "png_unique": fmts.count("PNG"),
        "megapixels_mean": sum(px) / max(1, len(px)) / 1e6,
        "encoded_mb": sum(len(wl.data[k]) for k in set(ids)) / 2**20,
    }


def exact_sample(wl: Workload, n_requests: int, count: int) -> list[int]:
    """Requests covering the largest image, a PNG, the most images, then the first ones."""
    meta = wl.manifest["images"]
    reqs = list(range(min(n_requests, len(wl.requests))))

    def biggest(i: int) -> int:
        return max(meta[k]["width"] * meta[k]["height"] for k in wl.requests[i].images)

    picks = [max(reqs, key=biggest), max(reqs, key=lambda i: len(wl.requests[i].images))]
    picks += [i for i in reqs if any(meta[k]["format"] == "PNG" for k in wl.requests[i].images)][:1]
    picks += reqs
    return list(dict.fromkeys(picks))[:count]
