"""Every registered architecture through the Engine, on both HF backends (audio adapters, whose
reference has no image backend, on one).

The fast path (the defaults: native transform, uint8 items, normalised by the device stage) must
equal the reference path (``transform="hf"``, ``mm_device_do_normalize=False``: the HF processor's
own CPU-normalised output) in token ids, placeholder ranges and every tensor, on a miss, a hit and
a request mixing cached and uncached items (encoded photos, or encoded clips for an adapter that
takes audio); and cached output must equal uncached output on
seeded random requests at several hit rates (the idea of vLLM's
``tests/models/multimodal/processing/test_common.py``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from parity import SEED, hf_processor, rel_err

from aiomm.adapters import build_processor, supported_adapters
from aiomm.cache.item_cache import CacheOutcome
from aiomm.config import EngineConfig, MultiModalConfig
from aiomm.engine import Engine
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request, Result

ADAPTERS = [info.short_name for info in supported_adapters()]
BACKENDS = ("torchvision", "pil")
#: what each architecture's requests carry: images, else (an audio adapter) audios
MODALITY = {
    info.short_name: "image" if "image" in info.processor_cls.supported_modalities else "audio"
    for info in supported_adapters()
}
#: (name, backend): both backends for an image adapter, one for an audio adapter
NAME_BACKENDS = [
    (name, backend)
    for name in ADAPTERS
    for backend in (BACKENDS if MODALITY[name] == "image" else BACKENDS[:1])
]
#: the clips an audio adapter's requests draw from: codecs, rates and channels vLLM reads
_CLIPS = (
    ("WAV", "PCM_16", 8000, 1),
    ("WAV", "FLOAT", 22050, 2),
    ("FLAC", "PCM_16", 44100, 2),
    ("MP3", "MPEG_LAYER_III", 22050, 1),
    ("OGG", "VORBIS", 48000, 2),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _images(rng: random.Random, count: int, modality: str = "image") -> list[bytes]:
    """Small encoded photos (JPEG and PNG, odd sizes), or short encoded clips of several codecs
    and rates for ``modality="audio"``: the engine's decode path runs too."""
    if modality == "audio":
        from audio_samples import AudioCase, signal
        from audio_samples import encode as encode_audio

        clips = []
        for _ in range(count):
            fmt, subtype, rate, channels = rng.choice(_CLIPS)
            seconds = rng.choice((0.05, 0.4, 1.3))
            case = AudioCase("clip", fmt, subtype, rate, channels, seconds)
            clips.append(encode_audio(case, signal(rate, channels, seconds, rng.randrange(99))))
        return clips
    out = []
    for _ in range(count):
        h, w = rng.randint(30, 150), rng.randint(30, 150)
        image = photo_like(np.random.default_rng(rng.randrange(2**32)), h, w)
        out.append(encode(image, rng.choice(("JPEG", "PNG"))))
    return out


def _request(name: str, prompt: str, items: list[Any]) -> Request:
    """A request of ``items`` as the architecture takes them (images, or audios)."""
    if MODALITY[name] == "audio":
        return Request(prompt=prompt, audios=items)
    return Request(prompt=prompt, images=items)


def _engine(name: str, backend: str, *, reference: bool, cache: bool = True) -> Engine:
    info = next(i for i in supported_adapters() if i.short_name == name)
    processing = MultiModalConfig()
    if reference:
        # The HF processor's own output; an adapter without an HF transform (Nemotron: its
        # reference is a re-statement) runs its native transform with CPU normalisation.
        transform = "hf" if getattr(info.processor_cls, "has_hf_transform", True) else "native"
        processing = MultiModalConfig(transform=transform, mm_device_do_normalize=False)
    config = EngineConfig(
        device="cpu",
        visual_dtype="float32",
        transform_threads=2,
        cache_capacity_bytes=(64 << 20) if cache else 0,
        processing=processing,
    )
    # the fast path builds by name (a stored snapshot where there is one: adapters/_stored.py),
    # the reference over the real HF processor
    hf = hf_processor(name, backend) if reference else None
    return Engine(build_processor(name, hf, config=processing, backend=backend), config)


def _prompt(engine: Engine, n: int) -> str:
    modality = "image" if "image" in engine.processor.supported_modalities else "audio"
    placeholder = engine.processor.dummy_inputs.get_dummy_text({modality: 1})
    return " ".join(["describe", *[f"the {placeholder}"] * n, "please"])


def assert_same(name: str, got: Result, want: Result) -> None:
    assert got.ok, got.error
    assert want.ok, want.error
    assert got.prompt_token_ids == want.prompt_token_ids, name
    assert got.mm_placeholders == want.mm_placeholders, name
    assert set(got.mm_kwargs) == set(want.mm_kwargs), name
    for key, value in want.mm_kwargs.items():
        other = got.mm_kwargs[key]
        if not isinstance(value, torch.Tensor):
            assert other == value, f"{name}: {key}"
            continue
        assert other.shape == value.shape and other.dtype == value.dtype, f"{name}: {key}"
        if value.is_floating_point():
            err = rel_err(other, value)
            assert err <= 1e-6, f"{name}: {key} rel. err {err:.3g} (seed {SEED})"
        else:
            assert torch.equal(other, value), f"{name}: {key} (seed {SEED})"


@pytest.mark.parametrize(("name", "backend"), NAME_BACKENDS)
async def test_fast_path_equals_reference_path(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-{name}-{backend}")
    a, b, c = _images(rng, 3, MODALITY[name])
    async with (
        _engine(name, backend, reference=False) as fast,
        _engine(name, backend, reference=True) as ref,
    ):
        first = _request(name, _prompt(fast, 2), [a, b])
        mixed = _request(name, _prompt(fast, 2), [b, c])
        for request, outcome in (
            (first, [CacheOutcome.MISS] * 2),
            (first, [CacheOutcome.HIT] * 2),
            (mixed, [CacheOutcome.HIT, CacheOutcome.MISS]),
        ):
            got, want = await fast.process(request), await ref.process(request)
            assert got.cache == outcome == want.cache
            assert_same(f"{name}/{backend}", got, want)


@pytest.mark.parametrize("hit_rate", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("name", ADAPTERS)
async def test_cached_equals_uncached(name: str, hit_rate: float) -> None:
    rng = random.Random(f"{SEED}-{name}-{hit_rate}")
    backend = rng.choice(BACKENDS) if MODALITY[name] == "image" else BACKENDS[0]
    pool = _images(rng, 3, MODALITY[name])
    seen: list[bytes] = []
    async with (
        _engine(name, backend, reference=False) as cached,
        _engine(name, backend, reference=False, cache=False) as uncached,
    ):
        for _ in range(4):
            images: list[Any] = []
            for _ in range(rng.randint(1, 3)):
                if seen and rng.random() < hit_rate:
                    images.append(rng.choice(seen))
                else:
                    images.append(pool.pop() if pool else _images(rng, 1, MODALITY[name])[0])
                    seen.append(images[-1])
            request = _request(name, _prompt(cached, len(images)), images)
            got, want = await cached.process(request), await uncached.process(request)
            assert want.cache == [CacheOutcome.UNCACHED] * len(images)
            assert_same(f"{name}/{backend} hit rate {hit_rate}", got, want)
        stats = cached.stats().cache
        if hit_rate == 1.0:
            assert stats.hits + stats.joins > 0
