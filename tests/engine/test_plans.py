"""Routing plans (``Engine.plan``) equal the full render, for every registered architecture (on
the PIL backend for every third one: a plan reads the processor's parameters, never its backend,
and the PIL transform's token counts equal torchvision's in the parity tests): the same token
ids, placeholder ranges, item ids and cache keys, or the same error, on seeded random images
(formats, modes, EXIF orientations, animation, sizes from 1 px to 8K) and, where the
architecture takes them, videos; with HF's decoding rule and with vLLM's, against the native
transform and the HF processor's own. Audio has no plan of its own: an audio item is processed
(and cached) by the plan, which then equals the full render too."""

from __future__ import annotations

import functools
import io
import random
from typing import Any

import numpy as np
import PIL.Image
import pytest
from video_samples import frames_of, make_video

from aiomm.adapters import build_processor, supported_adapters
from aiomm.cache.item_cache import CacheOutcome
from aiomm.config import DecodeConfig, EngineConfig, MultiModalConfig
from aiomm.engine import Engine
from aiomm.errors import AiommError
from aiomm.media.samples import photo_like
from aiomm.types import Request, Result
from aiomm.vllm.media import VllmDecoder
from aiomm.vllm.video_media import video_loader

#: the architectures that take images (an audio adapter's plan: test_audio_plan_...)
ADAPTERS = [
    info.short_name
    for info in supported_adapters()
    if "image" in info.processor_cls.supported_modalities
]
AUDIO_ADAPTERS = [
    info.short_name
    for info in supported_adapters()
    if "audio" in info.processor_cls.supported_modalities
]
#: (architecture, backend) pairs the plan is compared on
PAIRS = [(name, "torchvision") for name in ADAPTERS] + [(name, "pil") for name in ADAPTERS[::3]]
#: (format, mode, save kwargs)
KINDS: list[tuple[str, str, dict[str, Any]]] = [
    ("JPEG", "RGB", {"quality": 88}),
    ("JPEG", "L", {}),
    ("JPEG", "RGB", {"progressive": True}),
    ("PNG", "RGB", {}),
    ("PNG", "RGBA", {}),
    ("PNG", "P", {}),
    ("PNG", "L", {}),
    ("WEBP", "RGB", {"quality": 80}),
    ("GIF", "P", {}),
    ("BMP", "RGB", {}),
    ("TIFF", "RGB", {}),
]
SIZES = [(1, 1), (1, 37), (2, 500), (33, 21), (64, 48), (333, 777), (640, 480), (1080, 1920)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _image(rng: random.Random, width: int, height: int) -> bytes:
    fmt, mode, kwargs = rng.choice(KINDS)
    image = photo_like(np.random.default_rng(rng.randrange(2**32)), height, width).convert(mode)
    if fmt in ("JPEG", "PNG") and rng.random() < 0.4:
        exif = image.getexif()
        exif[0x0112] = rng.randint(1, 8)
        kwargs = {**kwargs, "exif": exif.tobytes()}
    buf = io.BytesIO()
    if fmt in ("GIF", "WEBP") and rng.random() < 0.5:  # animated: the first frame is the image
        second = photo_like(np.random.default_rng(rng.randrange(2**32)), height, width)
        image.save(buf, fmt, save_all=True, append_images=[second.convert(image.mode)],
                   duration=100, loop=0, **kwargs)  # fmt: skip
    else:
        image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _images(seed: int, count: int, *, smallest: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [rng.choice([s for s in SIZES if min(s) >= smallest]) for _ in range(count)]
    return [_image(rng, *(size if rng.random() < 0.5 else size[::-1])) for size in sizes]


def _engine(
    name: str, backend: str, *, vllm: bool = False, cache: bool = True, hf: bool = False
) -> Engine:
    """``hf``: the HF processor's own transform where the adapter has one (the reference)."""
    info = next(i for i in supported_adapters() if i.short_name == name)
    transform = "hf" if hf and getattr(info.processor_cls, "has_hf_transform", True) else "auto"
    processing = MultiModalConfig(transform=transform)
    processor = build_processor(name, backend=backend, config=processing)
    config = EngineConfig(
        device="cpu", transform_threads=2, return_items=True, processing=processing,
        cache_capacity_bytes=(64 << 20) if cache else 0,
    )  # fmt: skip
    decoder = None
    if vllm:
        loader = video_loader(type(getattr(processor, "video_processor", None)).__name__)
        decoder = VllmDecoder(DecodeConfig(), video_loader=loader or "qwen2_vl")
    return Engine(processor, config, decoder=decoder)


def _request(engine: Engine, images: list[bytes], videos: list[bytes] = ()) -> Request:  # type: ignore[assignment]
    dummy = engine.processor.dummy_inputs
    assert dummy is not None
    text = dummy.get_dummy_text({"image": len(images), "video": len(videos)})
    return Request(prompt=f"look: {text} and say", images=images, videos=list(videos))


async def _outcome(call: Any, request: Request) -> Result | type[AiommError]:
    try:
        return await call(request)
    except AiommError as exc:
        return type(exc)


def _assert_same(plan: Result | type, full: Result | type, what: Any) -> None:
    if isinstance(full, type) or isinstance(plan, type):
        assert plan == full, what
        return
    assert plan.prompt_token_ids == full.prompt_token_ids, what
    assert plan.mm_placeholders == full.mm_placeholders, what
    assert plan.item_ids == full.item_ids, what
    assert plan.item_hashes == full.item_hashes, what
    assert plan.mm_kwargs == {}


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "backend"), PAIRS, ids=[f"{n}-{b}" for n, b in PAIRS])
async def test_plan_equals_the_full_render(name: str, backend: str) -> None:
    seed = sum(map(ord, name + backend))
    for vllm in (False, True):
        # separate engines, no cache: the plan is made, not read from the full render's entry;
        # with vLLM's decoding rule, the full render is the HF processor's own transform
        async with _engine(name, backend, vllm=vllm, cache=False, hf=vllm) as engine:
            for k in range(6):
                # (HF's processors take an array of a side under 4 px for channels-first)
                images = _images(seed + k, 1 + k % 3, smallest=4 if vllm else 1)
                request = _request(engine, images)
                full = await _outcome(lambda r: engine.process(r, device=False), request)
                plan = await _outcome(engine.plan, request)
                _assert_same(plan, full, (name, backend, vllm, k))
            stats = engine.stats()
            assert stats.plans["header"] > 0 and stats.plans["decoded"] > 0, stats.plans
            assert stats.plans["processed"] == 0  # every adapter plans


@functools.cache
def _photo_8k() -> bytes:
    buf = io.BytesIO()
    photo_like(np.random.default_rng(8), 4320, 7680).save(buf, "JPEG", quality=85)
    return buf.getvalue()


@pytest.mark.anyio
@pytest.mark.parametrize("name", ADAPTERS)
async def test_plan_of_an_8k_photo(name: str) -> None:
    async with _engine(name, "torchvision", cache=False) as engine:
        request = _request(engine, [_photo_8k()])
        full = await _outcome(lambda r: engine.process(r, device=False), request)
        plan = await _outcome(engine.plan, request)
        _assert_same(plan, full, name)
        assert engine.stats().plans["header"] == 1


VIDEO_ADAPTERS = [
    info.short_name
    for info in supported_adapters()
    if "video" in build_processor(info.short_name).supported_modalities
]


def _videos() -> list[bytes]:
    return [
        make_video(frames_of(12, 48, 64, seed=1), "mpeg4", "mp4", rate=4),
        make_video(frames_of(9, 36, 52, seed=2), "libvpx", "webm", rate=3),
        make_video(frames_of(20, 40, 30, seed=3), "libx264", "matroska", "yuv444p", rate=8),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("name", VIDEO_ADAPTERS)
async def test_video_plan_equals_the_full_render(name: str) -> None:
    for vllm in (False, True):
        async with _engine(name, "torchvision", vllm=vllm, cache=False) as engine:
            for video in _videos():
                request = _request(engine, _images(3, 1), [video])
                full = await _outcome(lambda r: engine.process(r, device=False), request)
                plan = await _outcome(engine.plan, request)
                _assert_same(plan, full, (name, vllm))
            # vLLM's header rule reads the MP4 to its end: its frames are known without them;
            # the Matroska and WebM counts are estimated: their frames are decoded to know
            assert engine.stats().plans["decoded"] >= (2 if vllm else 3)


@pytest.mark.anyio
async def test_frames_in_memory_are_planned_from_their_shape() -> None:
    async with _engine("qwen2.5-vl", "torchvision", cache=False) as engine:
        frames = frames_of(7, 30, 44)
        pixels = np.asarray(photo_like(np.random.default_rng(0), 90, 60))
        request = _request(engine, [pixels], [frames])  # type: ignore[list-item]
        full = await engine.process(request, device=False)
        _assert_same(await engine.plan(request), full, "in memory")


@pytest.mark.anyio
async def test_plans_and_processed_items_answer_plans_from_the_cache() -> None:
    images = _images(11, 2)
    async with _engine("qwen2-vl", "torchvision") as engine:
        first = await engine.plan(_request(engine, images[:1]))
        again = await engine.plan(_request(engine, images[:1]))
        assert first.cache == [CacheOutcome.MISS] and again.cache == [CacheOutcome.HIT]
        # a processed item answers a plan at once; a plan never answers a tensor request
        full = await engine.process(_request(engine, images[1:]), device=False)
        planned = await engine.plan(_request(engine, images[1:]))
        assert planned.cache == [CacheOutcome.HIT]
        _assert_same(planned, full, "cached item")
        processed = await engine.process(_request(engine, images[:1]), device=False)
        assert (
            processed.cache == [CacheOutcome.MISS]
            and processed.items[0].data["pixel_values"].numel()
        )
        assert engine.stats().plans["cached"] == 2


@pytest.mark.anyio
async def test_a_request_the_full_render_refuses_is_refused_alike() -> None:
    corrupt = _images(4, 1)[0][:40]
    narrow = io.BytesIO()
    PIL.Image.new("RGB", (600, 2)).save(narrow, "PNG")  # an aspect ratio Qwen refuses
    async with _engine("qwen3-vl", "pil", vllm=True) as engine:
        for images in ([corrupt], [narrow.getvalue()], [b"not an image"]):
            request = _request(engine, images)
            full = await _outcome(lambda r: engine.process(r, device=False), request)
            assert isinstance(full, type)
            assert await _outcome(engine.plan, request) is full


@pytest.mark.anyio
async def test_decoded_plans_wait_for_the_byte_budget() -> None:
    # GIFs are decoded to be planned: their decodes are admitted one at a time here
    gifs = []
    for k in range(6):
        buf = io.BytesIO()
        photo_like(np.random.default_rng(k), 120 + k, 90).convert("P").save(buf, "GIF")
        gifs.append(buf.getvalue())
    processor = build_processor("qwen2-vl")
    config = EngineConfig(device="cpu", transform_threads=2, max_decoded_bytes_in_flight=1)
    async with Engine(processor, config) as engine:
        requests = [_request(engine, [gif]) for gif in gifs]
        async with engine.stream(requests, plan=True, raise_errors=True) as results:
            plans = [r async for r in results]
        assert engine.stats().plans["decoded"] == len(gifs)
        assert engine.stats().decoded_bytes.in_use == 0
    async with _engine("qwen2-vl", "torchvision") as engine:
        for k, plan in enumerate(plans):  # the stream keeps the requests' order
            _assert_same(plan, await engine.process(requests[k], device=False), k)


@pytest.mark.anyio
@pytest.mark.parametrize("name", AUDIO_ADAPTERS)
async def test_audio_plan_equals_the_full_render(name: str) -> None:
    from audio_samples import CASES, encode

    clips = [encode(case) for case in CASES[:3]]
    async with _engine(name, "torchvision", cache=True) as engine:
        dummy = engine.processor.dummy_inputs
        assert dummy is not None
        text = dummy.get_dummy_text({"audio": 3})
        request = Request(prompt=f"look: {text} and say", audios=clips)
        plan = await engine.plan(request)
        assert engine.stats().plans["processed"] == 3
        assert plan.cache == [CacheOutcome.MISS] * 3
        full = await engine.process(request, device=False)
        assert full.cache == [CacheOutcome.HIT] * 3  # the plan processed and cached them
        _assert_same(plan, full, name)
        async with _engine(name, "torchvision", cache=False) as fresh:
            _assert_same(plan, await fresh.process(request, device=False), name)
