"""The pixels each system delivered, against the HF processor's un-normalised pixels.

aiomm and vLLM deliver each image as an item of their render response (vLLM's msgpack wire
format, :mod:`aiomm.vllm.wire`); smg delivers a request's images as one tensor to its engine,
which the stand-in worker writes down (``smg_worker.write_received``). Either way each image
becomes its uint8 ``pixel_values`` rows and its ``(t, h, w)`` grid, compared with what the HF
processor makes of the same JPEG with ``do_rescale=False, do_normalize=False``.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

__all__ = (
    "Delivered",
    "ImageCheck",
    "SystemExactness",
    "body_images",
    "check_images",
    "check_params",
    "compare",
    "hf_pixels",
    "received_images",
    "render_images",
    "split_by_grid",
)

#: the preprocessor_config.json keys a Qwen-VL image processor must share with the folder
_PARAMS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")


@dataclass(frozen=True)
class Delivered:
    """One image as a system delivered it: uint8 rows and the ``(t, h, w)`` grid."""

    pixels: np.ndarray
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class ImageCheck:
    """One image against the reference: ``equal`` means same shape, grid and every value."""

    equal: bool
    grid_equal: bool
    shape_equal: bool
    max_abs_diff: int
    differing: int
    values: int


@dataclass
class SystemExactness:
    """A system's images checked against the reference, totalled."""

    system: str
    checks: list[ImageCheck] = field(default_factory=list)

    def add(self, check: ImageCheck) -> None:
        self.checks.append(check)

    def summary(self) -> dict[str, Any]:
        """Images checked and equal, the largest difference and the share of values differing
        (over every value compared; an image of another shape counts all its values)."""
        values = sum(c.values for c in self.checks)
        return {
            "system": self.system,
            "images": len(self.checks),
            "equal_images": sum(c.equal for c in self.checks),
            "grids_equal": sum(c.grid_equal for c in self.checks),
            "max_abs_diff": max((c.max_abs_diff for c in self.checks), default=0),
            "share_differing": round(sum(c.differing for c in self.checks) / values, 6)
            if values
            else 0.0,
            "all_equal": bool(self.checks) and all(c.equal for c in self.checks),
            "images_detail": [asdict(c) for c in self.checks],
        }


def compare(got: Delivered, ref: Delivered) -> ImageCheck:
    """``got`` against ``ref``: grids, shapes and every value (as integers)."""
    grid_equal = tuple(got.grid) == tuple(ref.grid)
    if got.pixels.shape != ref.pixels.shape:
        n = int(ref.pixels.size)
        return ImageCheck(False, grid_equal, False, 255, n, n)
    diff = np.abs(got.pixels.astype(np.int16) - ref.pixels.astype(np.int16))
    differing = int(np.count_nonzero(diff))
    max_abs = int(diff.max()) if diff.size else 0
    return ImageCheck(
        grid_equal and differing == 0, grid_equal, True, max_abs, differing, int(diff.size)
    )


def _as_uint8(values: np.ndarray) -> np.ndarray:
    """``values`` as uint8, which must hold them exactly (un-normalised pixels).

    :raises ValueError: a value that is not an integer in 0..255.
    """
    if values.dtype == np.uint8:
        return values
    if not np.array_equal(values, np.round(values)) or values.min() < 0 or values.max() > 255:
        raise ValueError(f"reference pixels ({values.dtype}) are not whole values in 0..255")
    return values.astype(np.uint8)


def hf_pixels(image_processor: Any, jpeg: bytes) -> Delivered:
    """The HF image processor's un-normalised pixels and grid for one encoded image."""
    image = PIL.Image.open(io.BytesIO(jpeg)).convert("RGB")
    out = image_processor(images=[image], do_rescale=False, do_normalize=False, return_tensors="np")
    grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1)[:3])
    return Delivered(_as_uint8(np.asarray(out["pixel_values"])), grid)  # type: ignore[arg-type]


def check_params(image_processor: Any, preprocessor_config: Mapping[str, Any]) -> list[str]:
    """Where ``image_processor`` differs from a folder's ``preprocessor_config.json`` (the
    parameters that shape the pixels: patch sizes, mean and std, min and max pixels)."""
    out = []
    for key in _PARAMS:
        if key in preprocessor_config:
            ours = getattr(image_processor, key, None)
            ours = list(ours) if isinstance(ours, (list, tuple)) else ours
            if ours != preprocessor_config[key]:
                out.append(f"{key}: {ours} != {preprocessor_config[key]}")
    size = preprocessor_config.get("size", {})
    theirs_size = image_processor.size
    for key in ("shortest_edge", "longest_edge"):
        if key in size:
            ours = (
                theirs_size.get(key)
                if isinstance(theirs_size, dict)
                else getattr(theirs_size, key, None)
            )
            if ours != size[key]:
                out.append(f"size.{key}: {ours} != {size[key]}")
    return out


def body_images(body: bytes | Mapping[str, Any]) -> list[bytes]:
    """The encoded images of a chat body's ``data:`` URLs, in the order they appear."""
    doc = json.loads(body) if isinstance(body, bytes) else body
    out = []
    for message in doc["messages"]:
        content = message["content"]
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image_url":
                url = part["image_url"]["url"]
                out.append(base64.b64decode(url.split(",", 1)[1]))
    return out


def render_images(response: Mapping[str, Any]) -> list[Delivered]:
    """The images of a render response (``features.kwargs_data.image``, vLLM's wire items).

    :raises ValueError: an item without uint8 ``pixel_values`` or without its grid.
    """
    from aiomm.vllm.wire import decode_item

    features = response.get("features") or {}
    out = []
    for encoded in (features.get("kwargs_data") or {}).get("image", []):
        item = decode_item(encoded)
        if "pixel_values" not in item or "image_grid_thw" not in item:
            raise ValueError(f"an image item with keys {sorted(item)}")
        pixels, grid = item["pixel_values"][0], item["image_grid_thw"][0]
        if pixels.dtype != "uint8":
            raise ValueError(f"pixel_values delivered as {pixels.dtype}, not uint8")
        thw = tuple(int(v) for v in grid.array().reshape(-1))
        out.append(Delivered(pixels.array(), thw))  # type: ignore[arg-type]
    return out


def split_by_grid(pixels: np.ndarray, grids: Sequence[Sequence[int]]) -> list[Delivered]:
    """One request's concatenated rows split into its images, by their grids.

    :raises ValueError: the grids do not account for every row.
    """
    sizes = [int(t) * int(h) * int(w) for t, h, w in grids]
    if sum(sizes) != pixels.shape[0]:
        raise ValueError(f"grids {list(grids)} account for {sum(sizes)} of {pixels.shape[0]} rows")
    bounds = np.cumsum([0, *sizes])
    return [
        Delivered(pixels[a:b], tuple(int(v) for v in g))  # type: ignore[arg-type]
        for a, b, g in zip(bounds[:-1], bounds[1:], grids, strict=True)
    ]


def received_images(folder: Path, index: int, wait_s: float = 10.0) -> list[Delivered]:
    """The images of the ``index``-th request the stand-in worker wrote to ``folder``.

    :raises FileNotFoundError: nothing written there within ``wait_s``.
    """
    meta_path = folder / f"{index:05d}.json"
    deadline = time.monotonic() + wait_s
    while not meta_path.exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(meta_path)
        time.sleep(0.05)
    meta = json.loads(meta_path.read_text())
    if meta["dtype"] != "uint8":
        raise ValueError(f"pixel_values received as {meta['dtype']}, not uint8")
    raw = np.fromfile(folder / f"{index:05d}.bin", dtype=np.uint8)
    return split_by_grid(raw.reshape(meta["shape"]), meta["image_grid_thw"])


def check_images(
    result: SystemExactness, delivered: Iterable[Delivered], references: Sequence[Delivered]
) -> None:
    """Add each delivered image's check against its reference to ``result`` (a missing or
    extra image counts as a wholly different one)."""
    delivered = list(delivered)
    for i, ref in enumerate(references):
        if i < len(delivered):
            result.add(compare(delivered[i], ref))
        else:
            n = int(ref.pixels.size)
            result.add(ImageCheck(False, False, False, 255, n, n))
    for extra in delivered[len(references) :]:
        n = int(extra.pixels.size)
        result.add(ImageCheck(False, False, False, 255, n, n))
