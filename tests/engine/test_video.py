"""Video requests through the Engine: equal to ``processor.apply``, cached per video and per
sampling parameters, bad videos a typed error of their own request only."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from parity import hf_processor
from video_samples import frames_of, make_video

from aiomm.adapters import build_processor
from aiomm.adapters.qwen_vl import VIDEO_PLACEHOLDER
from aiomm.cache.item_cache import CacheOutcome
from aiomm.config import DecodeConfig, EngineConfig, MultiModalConfig
from aiomm.engine import Engine
from aiomm.errors import DecodeError, UnknownModalityError, VideoTooLargeError
from aiomm.media.video import clip_from_frames, decode_video
from aiomm.types import Request

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SMALL = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}}
VIDEO = make_video(frames_of(12, 64, 96, seed=1))
OTHER = make_video(frames_of(9, 48, 80, seed=2), "libvpx", "webm")


def _engine(name: str = "qwen2.5-vl", **decode: int) -> Engine:
    config = EngineConfig(
        device="cpu",
        visual_dtype="float32",
        transform_threads=2,
        cache_capacity_bytes=64 << 20,
        decode=DecodeConfig(**decode),
    )
    return Engine(build_processor(name, hf_processor(name)), config)


def _expected(engine: Engine, prompt: str, videos: list[bytes], kwargs: dict, images=()):
    proc = engine.processor
    ids = proc.hf_processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    clips = [decode_video(v, lambda i: proc.sample_frames(i, kwargs)) for v in videos]
    data = {"video": clips, **({"image": list(images)} if images else {})}
    out = proc.apply(ids, data, kwargs)
    merged = out.merged_kwargs()
    norm = out.normalization
    assert norm is not None
    for key in ("pixel_values", "pixel_values_videos"):
        if key in merged:
            merged[key] = norm.module().forward_native(
                merged[key], torch.float32, layout=norm.layout
            )
    return out, merged


def _assert_equal(result, out, merged) -> None:
    assert result.ok, result.error
    assert result.prompt_token_ids == out.prompt_token_ids
    assert result.mm_placeholders == out.mm_placeholders
    assert set(result.mm_kwargs) == set(merged)
    for key, value in merged.items():
        assert torch.equal(result.mm_kwargs[key].cpu(), value), key


async def test_video_request_miss_then_hit_equals_apply() -> None:
    kwargs = {"do_sample_frames": True, "fps": 2.0, **SMALL}
    prompt = f"see {IMAGE} and {VIDEO_PLACEHOLDER} then {VIDEO_PLACEHOLDER}"
    image = frames_of(1, 40, 52, seed=5)[0]
    url = "data:video/webm;base64," + base64.b64encode(OTHER).decode()
    async with _engine() as engine:
        out, merged = _expected(engine, prompt, [VIDEO, OTHER], kwargs, images=[image])
        request = Request(prompt=prompt, images=[image], videos=[VIDEO, url],
                          mm_processor_kwargs=kwargs)  # fmt: skip
        first = await engine.process(request)
        _assert_equal(first, out, merged)
        assert first.cache == [CacheOutcome.MISS] * 3
        second = await engine.process(request)
        _assert_equal(second, out, merged)
        assert second.cache == [CacheOutcome.HIT] * 3
        # other sampling parameters: another item, computed afresh
        other = {"do_sample_frames": True, "num_frames": 8, **SMALL}
        out2, merged2 = _expected(engine, f"x {VIDEO_PLACEHOLDER}", [VIDEO], other)
        third = await engine.process(
            Request(prompt=f"x {VIDEO_PLACEHOLDER}", videos=[VIDEO], mm_processor_kwargs=other)
        )
        _assert_equal(third, out2, merged2)
        assert third.cache == [CacheOutcome.MISS]
        assert merged2["video_grid_thw"][0, 0] == 4 != merged["video_grid_thw"][0, 0]
        assert engine.stats().videos_processed == 5


async def test_frames_in_memory_and_device_normalisation() -> None:
    """A list of frames; the device stage's normalisation equals HF's CPU-normalised floats."""
    frames = frames_of(6, 40, 60, seed=7)
    prompt = f"a {VIDEO_PLACEHOLDER}"
    async with _engine("qwen2-vl") as engine:
        result = await engine.process(
            Request(prompt=prompt, videos=[list(frames)], mm_processor_kwargs=SMALL)
        )
        again = await engine.process(
            Request(prompt=prompt, videos=[frames], mm_processor_kwargs=SMALL)
        )
    assert result.ok and again.ok, (result.error, again.error)
    assert again.cache == [CacheOutcome.HIT]  # the same pixels, however they are given
    ref = hf_processor("qwen2-vl")(
        text=[prompt], videos=[frames], cap_pixels_per_frame=False, return_tensors="pt", **SMALL
    )
    got = result.mm_kwargs["pixel_values_videos"]
    err = (got.double() - ref["pixel_values_videos"].double()).abs().max().item()
    assert err < 1e-5, err
    assert result.prompt_token_ids == ref["input_ids"][0].tolist()


async def test_bad_videos_fail_alone() -> None:
    kwargs = {"do_sample_frames": True, "num_frames": 4, **SMALL}
    prompt = f"a {VIDEO_PLACEHOLDER}"
    async with _engine(max_video_frames=6) as engine:
        corrupt = await engine.process_safe(
            Request(
                prompt=prompt,
                videos=[b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 300],
                mm_processor_kwargs=kwargs,
            )
        )
        too_many = await engine.process_safe(Request(prompt=prompt, videos=[VIDEO]))  # every frame
        fine = await engine.process_safe(
            Request(prompt=prompt, videos=[VIDEO], mm_processor_kwargs=kwargs)
        )
    assert isinstance(corrupt.error, DecodeError) and corrupt.error.item_index == 0
    assert isinstance(too_many.error, VideoTooLargeError)
    assert "12 sampled frames" in str(too_many.error)
    assert fine.ok, fine.error


@pytest.mark.parametrize("name", ["qwen3-vl", "glm-4v", "glm-5-next"])
async def test_timestamped_video_miss_then_hit_equals_apply(name: str) -> None:
    """Qwen3-VL's and GLM-V's prompts read the timestamps kept with the (cached) item."""
    glm = "<|begin_of_video|><|video|><|end_of_video|>"
    placeholder = VIDEO_PLACEHOLDER if name == "qwen3-vl" else glm
    kwargs: dict = {"size": {"shortest_edge": 4096, "longest_edge": 65536}}
    if name == "glm-5-next":  # a token budget instead
        kwargs = {"min_image_tokens": 4, "max_image_tokens": 40}
    prompt = f"see {placeholder} then {placeholder}"
    request = Request(prompt=prompt, videos=[VIDEO, OTHER], mm_processor_kwargs=kwargs)
    async with _engine(name) as engine:
        out, merged = _expected(engine, prompt, [VIDEO, OTHER], kwargs)
        assert all(p.is_embed is not None for p in out.mm_placeholders["video"])
        first = await engine.process(request)
        _assert_equal(first, out, merged)
        second = await engine.process(request)
        _assert_equal(second, out, merged)
        assert second.cache == [CacheOutcome.HIT] * 2


async def test_video_for_an_image_only_adapter_is_refused() -> None:
    async with _engine("mistral3") as engine:
        result = await engine.process_safe(Request(prompt="a", videos=[VIDEO]))
    assert isinstance(result.error, UnknownModalityError)


def test_video_item_survives_the_shared_cache_codec() -> None:
    from aiomm.cache.codec import decode_item, encode_item

    proc = build_processor("qwen2.5-vl", hf_processor("qwen2.5-vl"))
    clip = decode_video(VIDEO, lambda i: range(4))
    item = proc.process_items({"video": [clip]}, SMALL)["video"][0]
    back = decode_item(encode_item(item))
    assert back.modality == "video" and set(back.data) == set(item.data)
    for key, value in item.data.items():
        assert torch.equal(back.data[key], value), key
    assert back.fields == item.fields


def test_clip_from_frames_checks() -> None:
    from aiomm.errors import EmptyVideoError, InvalidSourceError

    with pytest.raises(EmptyVideoError):
        clip_from_frames([], max_frames=4, max_bytes=1 << 20)
    with pytest.raises(InvalidSourceError, match="differ in shape"):
        clip_from_frames([np.zeros((4, 4, 3), np.uint8), np.zeros((5, 4, 3), np.uint8)],
                         max_frames=4, max_bytes=1 << 20)  # fmt: skip
    with pytest.raises(VideoTooLargeError):
        clip_from_frames(np.zeros((5, 4, 4, 3), np.uint8), max_frames=4, max_bytes=1 << 20)
    _ = MultiModalConfig  # the engine's processing config is the default one here
