"""Gemma 4's adapter: target sizes and soft-token counts against transformers' for many sizes
(arithmetic only), the prompt replacements vLLM builds (images, and videos: timestamped frames of
at most 70 soft tokens), the video transform against the HF processor as vLLM calls it, the item
layout, and refusals."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

from aiomm.adapters import build_processor, get_adapter_info
from aiomm.adapters.gemma4 import (
    SUPPORTED_SOFT_TOKENS,
    gemma4_num_soft_tokens,
    gemma4_target_size,
    gemma4_timestamp,
)
from aiomm.errors import ProcessorKwargsError, UnknownModalityError
from aiomm.media.samples import photo_like
from aiomm.media.video import SampledVideo, VideoClip, VideoInfo
from aiomm.processing.fields import FieldKind
from aiomm.processing.processor import MultiModalConfig
from aiomm.vllm.generate_request import WireForm
from aiomm.vllm.video_media import video_loader

#: sides from 1 px to 8K, with 48-px multiples and their neighbours (the rounding edges)
SIDES = sorted({1, 2, 3, 5, 7, 16, 33, 47, 48, 49, 95, 96, 97, 150, 224, 333, 480, 500, 640,
                767, 768, 769, 803, 804, 1080, 1920, 2048, 4000, 7680})  # fmt: skip


@pytest.fixture(scope="module")
def hf_processor() -> Any:
    return get_adapter_info("gemma4").build_hf_processor()


@pytest.fixture(scope="module")
def processor(hf_processor: Any) -> Any:
    return build_processor("gemma4", hf_processor, config=MultiModalConfig(transform="native"))


@pytest.mark.parametrize("max_soft_tokens", SUPPORTED_SOFT_TOKENS)
def test_target_size_and_token_count_match_transformers(max_soft_tokens: int) -> None:
    """The resize target equals transformers'; vLLM's prompt count (restated here) equals the
    patches the transform keeps, divided by the 3 x 3 pooling, for every pair of sides."""
    max_patches = max_soft_tokens * 9
    for h, w in itertools.product(SIDES, SIDES):
        expected = get_aspect_ratio_preserving_size(h, w, 16, max_patches, 3)
        got = gemma4_target_size(h, w, patch_size=16, max_patches=max_patches,
                                 pooling_kernel_size=3)  # fmt: skip
        assert got == expected, (h, w, max_soft_tokens)
        th, tw = got
        assert th % 48 == 0 and tw % 48 == 0 and (th // 16) * (tw // 16) <= max_patches
        tokens = gemma4_num_soft_tokens(
            h, w, patch_size=16, pooling_kernel_size=3, max_soft_tokens=max_soft_tokens
        )
        assert tokens == (th // 16) * (tw // 16) // 9, (h, w, max_soft_tokens)


def test_token_count_matches_the_hf_processor(hf_processor: Any) -> None:
    sizes = [[h, w] for h, w in itertools.product(SIDES[::3], SIDES[::2])]
    counts = hf_processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    ours = [
        gemma4_num_soft_tokens(h, w, patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)
        for h, w in sizes
    ]
    assert ours == counts


def _prompt(processor: Any, n: int) -> list[int]:
    tok = processor.hf_processor.tokenizer
    return tok.encode("user describe " + " ".join(["<|image|>"] * n) + " assistant")


def test_prompt_replacement_and_item_layout(processor: Any) -> None:
    rng = np.random.default_rng(0)
    images = [photo_like(rng, 240, 320), photo_like(rng, 20, 700)]
    prompt = _prompt(processor, 2)
    out = processor.apply(prompt, {"image": images}, {})
    boi, image, eoi = processor.boi_token_id, processor.image_token_id, processor.eoi_token_id
    expected_counts = [
        gemma4_num_soft_tokens(h, w, patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)
        for h, w in ((240, 320), (20, 700))
    ]
    ranges = out.mm_placeholders["image"]
    for r, n in zip(ranges, expected_counts, strict=True):
        tokens = out.prompt_token_ids[r.offset : r.offset + r.length]
        assert tokens == [boi, *[image] * n, eoi]
        assert r.is_embed is not None and list(r.is_embed) == [False, *[True] * n, False]
    assert out.prompt_token_ids.count(image) == sum(expected_counts)

    for item, n in zip(out.mm_kwargs["image"], expected_counts, strict=True):
        assert list(item.data) == ["pixel_values", "pixel_position_ids"]
        pixels, positions = item.data["pixel_values"], item.data["pixel_position_ids"]
        assert pixels.shape == (2520, 768) and pixels.dtype == torch.float32
        assert positions.shape == (2520, 2) and positions.dtype == torch.long
        real = n * 9
        assert (positions[:real] >= 0).all() and (positions[real:] == -1).all()
        assert not pixels[real:].any()
        # raster order: x runs fastest
        cols = int(positions[:real, 0].max()) + 1
        assert positions[1, 0] == (1 if cols > 1 else 0)
        assert positions[cols].tolist() == [0, 1]


@pytest.mark.parametrize("max_soft_tokens", [70, 1120])
def test_max_soft_tokens_per_request(processor: Any, max_soft_tokens: int) -> None:
    image = photo_like(np.random.default_rng(1), 600, 800)
    kwargs = {"max_soft_tokens": max_soft_tokens}
    out = processor.apply(_prompt(processor, 1), {"image": [image]}, kwargs)
    (r,) = out.mm_placeholders["image"]
    n = gemma4_num_soft_tokens(
        600, 800, patch_size=16, pooling_kernel_size=3, max_soft_tokens=max_soft_tokens
    )
    assert r.length == n + 2
    assert out.mm_kwargs["image"][0].data["pixel_values"].shape[0] == max_soft_tokens * 9
    plan = processor.plan_image(600, 800, kwargs)
    assert plan.prompt_data["tokens"] == out.mm_kwargs["image"][0].prompt_data["tokens"] == n


@pytest.mark.parametrize(
    "kwargs", [{"max_soft_tokens": 100}, {"patch_size": 14}, {"pooling_kernel_size": 2}]
)
def test_refused_kwargs(processor: Any, kwargs: dict[str, Any]) -> None:
    image = photo_like(np.random.default_rng(2), 32, 32)
    with pytest.raises(ProcessorKwargsError):
        processor.apply(_prompt(processor, 1), {"image": [image]}, kwargs)
    with pytest.raises(ProcessorKwargsError):
        processor.validate_hf_kwargs(kwargs)


def test_audio_is_refused(processor: Any) -> None:
    with pytest.raises(UnknownModalityError):
        processor.apply(_prompt(processor, 0), {"audio": [np.zeros(1600, np.float32)]})


# ------------------------------------------------------------------------------------ videos

#: (frames, height, width): small, a frame kept at its size (48 x 96), a large one, thin ones
VIDEO_SHAPES = [(3, 30, 40), (2, 48, 96), (2, 720, 1280), (2, 2, 300), (2, 97, 203)]


def _video_prompt(processor: Any, videos: int, images: int = 0) -> list[int]:
    tok = processor.hf_processor.tokenizer
    parts = ["<|image|>"] * images + ["<|video|>"] * videos
    return tok.encode("user describe " + " ".join(parts) + " assistant")


def _frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_video_transform_equals_the_hf_processor_as_vllm_calls_it(backend: str) -> None:
    """Each frame through the image processor at 70 soft tokens (vLLM's ``Gemma4
    MultiModalProcessor`` hands every video's frames over as images): the native items equal
    those of the HF processor called that way, on both backends, with an image beside."""
    hf = get_adapter_info("gemma4").build_hf_processor(backend=backend)
    native = build_processor("gemma4", hf, config=MultiModalConfig(transform="native"))
    reference = build_processor("gemma4", hf, config=MultiModalConfig(transform="hf"))
    image = photo_like(np.random.default_rng(3), 50, 70)
    for k, shape in enumerate(VIDEO_SHAPES):
        clip = VideoClip(_frames(*shape, seed=k), 7.5, 40, tuple(range(0, 40, 13))[: shape[0]])
        mm = {"image": [image], "video": [clip, _frames(2, 36, 20, seed=9)]}
        ours = native.process_items(mm, {})
        theirs = reference.process_items(mm, {})
        for modality in ("image", "video"):
            for a, b in zip(ours[modality], theirs[modality], strict=True):
                assert list(a.data) == list(b.data), (backend, shape)
                for key, value in a.data.items():
                    if isinstance(value, torch.Tensor):
                        assert value.dtype == b.data[key].dtype, (backend, shape, key)
                        assert torch.equal(value, b.data[key]), (backend, shape, key)
                    else:
                        assert value == b.data[key], (backend, shape, key)


def test_video_frames_equal_hf_video_processor_up_to_its_rounding(processor: Any) -> None:
    """HF's ``Gemma4VideoProcessor`` (which vLLM does not call) resizes alike and places the
    patches and positions alike; its fused rescale-and-normalise rounds a last float32 bit
    otherwise, so the pixels agree to one unit in the last place (the same uint8 levels)."""
    for k, shape in enumerate(VIDEO_SHAPES[:3]):
        frames = _frames(*shape, seed=20 + k)
        (item,) = processor.process_items({"video": [frames]}, {})["video"]
        hf = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        assert torch.equal(item.data["pixel_position_ids_videos"], hf["video_position_ids"])
        pixels = item.data["pixel_values_videos"]
        assert torch.allclose(pixels, hf["pixel_values_videos"], rtol=0, atol=2**-23)
        assert torch.equal((pixels * 255).round(), (hf["pixel_values_videos"] * 255).round())
        n = gemma4_num_soft_tokens(*shape[1:], patch_size=16, pooling_kernel_size=3,
                                   max_soft_tokens=70)  # fmt: skip
        assert hf["num_soft_tokens_per_video"].tolist() == [n], shape


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "00:00"), (0.99, "00:00"), (59.999, "00:59"), (60.0, "01:00"), (61.5, "01:01"),
     (3599.9, "59:59"), (3600.0, "60:00"), (6001.0, "100:01")],
)  # fmt: skip
def test_timestamp_text(seconds: float, text: str) -> None:
    assert gemma4_timestamp(seconds) == text


def test_video_prompt_and_item_layout(processor: Any) -> None:
    """Each ``<|video|>`` becomes, per frame, the tokens of ``"mm:ss "`` (``" mm:ss "`` after
    the first) and ``<|image>`` + ``<|video|>`` x n + ``<image|>``, only the soft tokens
    embedded (vLLM's ``get_video_repl``, restated); the items hold vLLM's fields, the frames of
    a request's videos split by their frame counts, at 70 soft tokens whatever the request's."""
    tok = processor.hf_processor.tokenizer
    a = VideoClip(_frames(3, 30, 40, seed=1), 0.5, 90, (0, 44, 89))
    b = _frames(2, 720, 1280, seed=2)  # frames without metadata: every frame, 24 fps
    out = processor.apply(_video_prompt(processor, 2, 1), {"video": [a, b], "image": [
        photo_like(np.random.default_rng(4), 64, 64)]}, {"max_soft_tokens": 1120})  # fmt: skip
    boi, video, eoi = processor.boi_token_id, processor.video_token_id, processor.eoi_token_id
    cases = [([0.0, 88.0, 178.0], 63), ([0.0, 1 / 24], 66)]
    for r, item, (seconds, n) in zip(out.mm_placeholders["video"], out.mm_kwargs["video"], cases,
                                      strict=True):  # fmt: skip
        expected: list[int] = []
        for i, s in enumerate(seconds):
            text = f"{int(s // 60):02d}:{int(s % 60):02d} "
            expected += tok.encode(f" {text}" if i else text, add_special_tokens=False)
            expected += [boi, *[video] * n, eoi]
        assert out.prompt_token_ids[r.offset : r.offset + r.length] == expected
        assert r.is_embed is not None and list(r.is_embed) == [t == video for t in expected]
        assert list(item.data) == [
            "pixel_values_videos", "pixel_position_ids_videos", "video_frame_counts",
            "video_num_soft_tokens", "video_timestamps",
        ]  # fmt: skip
        t = len(seconds)
        assert item.data["pixel_values_videos"].shape == (t, 630, 768)
        assert item.data["pixel_position_ids_videos"].shape == (t, 630, 2)
        assert item.data["video_frame_counts"].dtype == torch.long
        assert int(item.data["video_frame_counts"]) == t
        assert item.data["video_num_soft_tokens"] == [n] * t
        assert item.data["video_timestamps"] == seconds
        fields = item.fields
        assert fields["pixel_values_videos"].kind is FieldKind.FLAT
        assert fields["pixel_values_videos"].sizes == (3, 2)  # the request's videos, one batch
        assert fields["video_timestamps"].kind is FieldKind.BATCHED
        plan = processor.plan_video(SampledVideo.of_clip(
            a if t == 3 else VideoClip(b, None, 2, (0, 1))), {})  # fmt: skip
        assert plan.prompt_data == {
            "video_num_soft_tokens": [n] * t, "video_timestamps": seconds,
        }  # fmt: skip
    # the image keeps the request's max_soft_tokens
    assert out.mm_kwargs["image"][0].data["pixel_values"].shape[0] == 1120 * 9


def test_vllm_loader_and_wire_form(processor: Any) -> None:
    """vLLM 0.33 gives Gemma 4 no loader of its own: its default ``"opencv"`` loader reads the
    videos, all of a request's in one batch (flat slices across them, timestamps kept as the
    item's own field)."""
    assert video_loader(type(processor.video_processor).__name__) == "opencv"
    wire = WireForm.of(processor)
    assert not wire.per_video_slices and not wire.timestamps_field
    assert processor.sample_frames(VideoInfo(40, 10.0, 30, 40), {}) == list(range(40))


def test_video_item_survives_the_shared_cache_codec(processor: Any) -> None:
    from aiomm.cache.codec import decode_item, encode_item

    clip = VideoClip(_frames(2, 30, 40, seed=5), 10.0, 20, (0, 19))
    item = processor.process_items({"video": [clip]}, {})["video"][0]
    back = decode_item(encode_item(item))
    assert back.modality == "video" and list(back.data) == list(item.data)
    for key, value in item.data.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back.data[key], value), key
        else:
            assert back.data[key] == value, key
    assert back.fields == item.fields


@pytest.mark.anyio
async def test_videos_through_the_engine(processor: Any) -> None:
    """Two videos and an image through the Engine equal ``apply`` (every frame), a second time
    from the cache; with vLLM's default loader (:class:`VllmDecoder`) a 45-frame video gives 32
    frames, timed by their source indices."""
    from video_samples import frames_of, make_video

    from aiomm.cache.item_cache import CacheOutcome
    from aiomm.config import DecodeConfig, EngineConfig
    from aiomm.engine import Engine
    from aiomm.media.video import decode_video
    from aiomm.types import Request
    from aiomm.vllm.media import VllmDecoder
    from aiomm.vllm.video_media import sample_indices_uniform

    videos = [make_video(frames_of(t, 40, 56, seed=t), rate=8) for t in (5, 9)]
    image = frames_of(1, 40, 52, seed=5)[0]
    config = EngineConfig(
        device="cpu", visual_dtype="float32", transform_threads=2, cache_capacity_bytes=64 << 20
    )
    prompt = "<|turn>user\n<|image|> <|video|> <|video|> Say.<turn|>\n"
    ids = processor.hf_processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    clips = [decode_video(v, lambda i: processor.sample_frames(i, {})) for v in videos]
    out = processor.apply(ids, {"image": [image], "video": clips})
    merged = out.merged_kwargs()
    async with Engine(processor, config) as engine:
        request = Request(prompt=prompt, images=[image], videos=videos)
        first = await engine.process(request)
        second = await engine.process(request)
    for result in (first, second):
        assert result.ok, result.error
        assert result.prompt_token_ids == out.prompt_token_ids
        assert result.mm_placeholders == out.mm_placeholders
        got = result.mm_kwargs
        assert got["pixel_values_videos"].shape == (14, 630, 768)
        assert torch.equal(got["pixel_values_videos"].cpu(), merged["pixel_values_videos"])
        assert got["video_timestamps"] == merged["video_timestamps"] == [
            [i / 8 for i in range(5)], [i / 8 for i in range(9)],
        ]  # fmt: skip
    assert second.cache == [CacheOutcome.HIT] * 3
    decoder = VllmDecoder(DecodeConfig(), video_loader="opencv")
    long = make_video(frames_of(45, 24, 32, seed=3), rate=10)
    async with Engine(processor, config, decoder=decoder) as engine:
        result = await engine.process(Request(prompt="<|video|>", videos=[long]))
    assert result.ok, result.error
    indices = sample_indices_uniform(VideoInfo(45, 10.0, 24, 32))
    assert result.mm_kwargs["video_timestamps"] == [[i / 10 for i in indices]]
    n = gemma4_num_soft_tokens(24, 32, patch_size=16, pooling_kernel_size=3, max_soft_tokens=70)
    assert result.mm_kwargs["video_num_soft_tokens"] == [[n] * 32]
    (r,) = result.mm_placeholders["video"]
    assert r.is_embed is not None and sum(r.is_embed) == 32 * n


@pytest.mark.anyio
async def test_video_device_normalisation_equals_the_cpu_path() -> None:
    """With device normalisation the uint8 frame patches are rescaled by the device stage
    exactly as the CPU path rescales them (one scale, no mean or std)."""
    from video_samples import frames_of, make_video

    from aiomm.config import EngineConfig
    from aiomm.engine import Engine
    from aiomm.types import Request

    video = make_video(frames_of(6, 40, 56, seed=1), rate=8)
    image = frames_of(1, 30, 50, seed=2)[0]
    results = []
    for on in (True, False):
        processing = MultiModalConfig(mm_device_do_normalize=on)
        config = EngineConfig(
            device="cpu", visual_dtype="float32", transform_threads=2, cache_capacity_bytes=0,
            processing=processing,
        )  # fmt: skip
        async with Engine(build_processor("gemma4", config=processing), config) as engine:
            request = Request(prompt="<|image|> <|video|>", images=[image], videos=[video])
            result = await engine.process(request)
        assert result.ok, result.error
        results.append(result.mm_kwargs)
    device, cpu = results
    assert list(device) == list(cpu)
    for key, value in device.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == cpu[key].dtype and torch.equal(value.cpu(), cpu[key].cpu()), key
        else:
            assert value == cpu[key], key
