"""Photo-like sample images, generated (seeded) for the CLI's defaults, tests and benchmarks.

Not noise and not flat colour: smooth gradients, hard edges and fine texture, so that resampling
filters and JPEG see the structure of real photos.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import PIL.Image

__all__ = ("encode", "photo_like", "write_samples")

DEFAULT_SIZES: tuple[tuple[int, int], ...] = (
    (480, 640), (768, 1024), (1080, 1920), (600, 400), (333, 500), (1536, 2048), (224, 224),
)  # fmt: skip


def photo_like(rng: np.random.Generator, height: int, width: int) -> PIL.Image.Image:
    """An RGB image of ``height x width`` with gradients, edges and texture."""
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0, 6.3, size=3).astype(np.float32)
    freq = rng.uniform(2, 9, size=3).astype(np.float32)
    cx, cy = rng.uniform(0.2, 0.8, size=2)
    disc = ((x - cx) ** 2 + (y - cy) ** 2) < 0.05
    channels = []
    for c in range(3):
        wave = 127 + 90 * np.sin(freq[c] * x + 3 * y + phase[c])
        stripes = 25 * (((x * 11 + y * 7) % 1) > 0.5)
        channels.append(wave + stripes + 60 * disc)
    img = np.stack(channels, axis=-1)
    img += rng.normal(0, 10, size=img.shape).astype(np.float32)
    return PIL.Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def encode(image: PIL.Image.Image, fmt: str = "JPEG", quality: int = 90) -> bytes:
    """Encode an image to bytes (JPEG or PNG)."""
    buf = io.BytesIO()
    kwargs = {"quality": quality} if fmt.upper() == "JPEG" else {}
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def write_samples(
    folder: Path,
    count: int,
    *,
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] = DEFAULT_SIZES,
) -> list[Path]:
    """Write ``count`` sample images (JPEG and PNG alternating) into ``folder``."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        fmt = "PNG" if i % 4 == 3 else "JPEG"
        path = folder / f"sample_{i:04d}.{fmt.lower().replace('jpeg', 'jpg')}"
        path.write_bytes(encode(photo_like(rng, h, w), fmt))
        paths.append(path)
    return paths
