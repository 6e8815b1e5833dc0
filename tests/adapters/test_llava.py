"""LLaVA-NeXT and LLaVA-OneVision cases beyond the parity harness: the anyres grid and the
placeholder counts against transformers' and vLLM's rules, items that hold their own patches and
merge into HF's padded batch, processor kwargs, and the errors."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from adapter_parity import check_case, prompt_text
from parity import SEED, hf_processor
from video_samples import frames_of, make_video

from aiomm.adapters import build_processor
from aiomm.adapters.llava import (
    LLAVA_NEXT_PINPOINTS,
    ONEVISION_PINPOINTS,
    VideoFramesField,
    fit_size,
    select_best_resolution,
    unpadded_features,
)
from aiomm.errors import (
    ConfigError,
    ProcessingError,
    ProcessorKwargsError,
)
from aiomm.media.samples import photo_like
from aiomm.media.video import SampledVideo, VideoClip, VideoInfo
from aiomm.processing.fields import PaddedPatchesField, merge_items
from aiomm.processing.processor import MultiModalConfig
from aiomm.vllm.media import VllmDecoder
from aiomm.vllm.video_media import (
    VllmVideoInfo,
    hash_metadata,
    sample_indices_uniform,
    video_loader,
)

NAME = "llava-next"


def _sizes(n: int, seed: int) -> list[tuple[int, int]]:
    """Seeded image sizes: thin, square, pinpoint multiples and random ones."""
    rng = random.Random(seed)
    fixed = [(1, 1), (1, 1100), (1100, 1), (2, 600), (336, 336), (336, 672), (672, 336),
             (1008, 336), (337, 1009), (672, 673), (1080, 1920), (3000, 40)]  # fmt: skip
    return fixed + [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(n)]


def test_grid_and_fit_equal_transformers() -> None:
    from transformers.image_processing_utils import get_patch_output_size
    from transformers.image_processing_utils import select_best_resolution as hf_best

    for h, w in _sizes(400, SEED):
        best = select_best_resolution(h, w, LLAVA_NEXT_PINPOINTS)
        assert best == tuple(hf_best((h, w), LLAVA_NEXT_PINPOINTS)), (h, w, SEED)
        image = np.zeros((3, h, w), dtype=np.uint8)
        hf_fit = get_patch_output_size(image, best, input_data_format="channels_first")
        assert fit_size(h, w, *best) == tuple(hf_fit), (h, w, best, SEED)


def test_placeholder_count_equals_vllm_and_hf() -> None:
    """The count follows vLLM's ``get_num_image_tokens`` (restated from
    ``vllm/model_executor/models/llava_next.py``) and equals HF's processor's count."""
    proc = hf_processor(NAME, "torchvision")
    ours = build_processor(NAME, proc)
    for h, w in _sizes(300, SEED + 1):
        rows, cols = (v // 336 for v in select_best_resolution(h, w, LLAVA_NEXT_PINPOINTS))
        unpadded, newline = unpadded_features(h, w, 24, rows, cols)
        vllm_count = 24 * 24 + unpadded + newline  # CLIP's 577 minus the CLS ("default")
        assert ours.num_image_tokens(h, w) == vllm_count, (h, w)
        hf_count = proc._get_number_of_features(h, w, 336, 336) - 1
        assert vllm_count == hf_count, (h, w)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_parity_many_images(backend: str) -> None:
    """Up to four images of the harness's sizes (and pinpoint multiples), classic path too."""
    rng = random.Random(f"{SEED}-{NAME}-{backend}")
    for n_images in (1, 2, 3, 4):
        check_case(NAME, backend, n_images, rng.randrange(2**31), classic=n_images == 2)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_parity_large_and_thin_images(backend: str) -> None:
    check_case(NAME, backend, 3, SEED, sizes=[(1080, 1920), (1, 1100), (2000, 600)], classic=True)


@pytest.mark.parametrize("mode", ["hf", "native"])
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_items_hold_their_own_patches(backend: str, mode: str) -> None:
    """Items processed alone equal items processed in a padded batch, each holds only its own
    ``1 + rows * cols`` patches, and any merge of them reproduces HF's padded batch."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 900), photo_like(nrng, 500, 333), photo_like(nrng, 41, 41)]
    proc = hf_processor(NAME, backend)
    config = MultiModalConfig(transform=mode, mm_device_do_normalize=True)
    ours = build_processor(NAME, proc, config=config)
    batch = ours.process_items({"image": images}, {})["image"]
    alone = [ours.process_items({"image": [image]}, {})["image"][0] for image in images]
    for a, b, patches in zip(alone, batch, (4, 3, 3), strict=True):
        for key in ("pixel_values", "image_sizes"):
            assert torch.equal(a.data[key], b.data[key]), f"{backend}/{mode} seed={SEED}"
        for item in (a, b):  # no item keeps the padded batch alive
            pv = item.data["pixel_values"]
            assert pv.shape == (patches, 3, 336, 336), pv.shape
            assert pv.untyped_storage().nbytes() == pv.nbytes and pv.is_contiguous()
    for order in ([2, 0], [1, 2], [0, 1, 2], [2]):
        merged = merge_items([alone[i] for i in order])
        ref = proc(
            text=[prompt_text(NAME, len(order))], images=[images[i] for i in order],
            return_tensors="pt", do_rescale=False, do_normalize=False,
        )  # fmt: skip
        assert torch.equal(merged["pixel_values"], ref["pixel_values"]), f"{order} seed={SEED}"
        assert torch.equal(merged["image_sizes"], ref["image_sizes"]), f"{order} seed={SEED}"


def test_padded_patches_field_finish_and_errors() -> None:
    field = PaddedPatchesField(counts=(2, 1))
    batch = torch.arange(2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 3) + 1
    items = field.split("pixel_values", batch)
    assert [tuple(v.shape) for v in items] == [(2, 3), (1, 3)]
    merged = field.merge(items)
    assert torch.equal(merged[1, 1], torch.zeros(3)) and torch.equal(merged[0], batch[0])
    assert field.concat_parts(items) is None
    normalised = merged - 5  # the device stage turned the padding patch into -5
    assert torch.equal(field.finish(normalised, items)[1, 1], torch.zeros(3))
    with pytest.raises(ProcessingError, match="patch counts"):
        field.split("pixel_values", batch[:1])
    with pytest.raises(ProcessingError, match="patches where"):
        PaddedPatchesField(counts=(3, 1)).split("pixel_values", batch)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    "kwargs", [{"resample": 2}, {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}]
)
def test_processor_kwargs(backend: str, kwargs: dict[str, Any]) -> None:
    check_case(NAME, backend, 2, SEED, sizes=[(300, 500), (620, 90)], kwargs=kwargs, classic=True)


@pytest.mark.parametrize("key", ["image_grid_pinpoints", "size", "crop_size"])
def test_grid_kwargs_are_refused(key: str) -> None:
    """vLLM counts tokens from the model config's grid: a request may not change it."""
    ours = build_processor(NAME)
    with pytest.raises(ProcessorKwargsError, match=key):
        ours.apply([0], {"image": [photo_like(np.random.default_rng(0), 20, 20)]}, {key: None})


def test_plan_equals_the_processed_item() -> None:
    ours = build_processor(NAME)
    image = photo_like(np.random.default_rng(SEED), 123, 456)
    item = ours.process_items({"image": [image]}, {})["image"][0]
    plan = ours.plan_image(123, 456, {})
    assert torch.equal(plan.data["image_sizes"], item.data["image_sizes"])
    ids = [ours.image_token_id]
    assert (
        ours.assemble(ids, {"image": [plan]}).prompt_token_ids
        == ours.assemble(ids, {"image": [item]}).prompt_token_ids
    )


def test_sizes_that_disagree_are_a_config_error() -> None:
    proc = hf_processor(NAME, "torchvision")
    from aiomm.adapters.llava import build_hf_processor

    other = build_hf_processor(crop_size={"height": 224, "width": 224})
    with pytest.raises(ConfigError, match="crop_size"):
        build_processor(NAME, other)
    assert build_processor(NAME, proc).patch == 336


# ------------------------------------------------------------------------------- OneVision

ONEVISION = "llava-onevision"


def test_onevision_count_equals_vllm_and_hf() -> None:
    """OneVision's ``anyres_max_9`` count (vLLM's ``_get_num_unpadded_features``, restated from
    ``vllm/model_executor/models/llava_onevision.py``) equals HF's for single images, the way
    vLLM calls HF (a flat image list: every image patched)."""
    proc = hf_processor(ONEVISION, "torchvision")
    ours = build_processor(ONEVISION, proc)
    assert (ours.npatches, ours.base_features, ours.max_patches) == (27, 729, 9)
    for h, w in _sizes(300, SEED + 3):
        rows, cols = (v // 384 for v in select_best_resolution(h, w, ONEVISION_PINPOINTS))
        current_h, current_w = 27 * rows, 27 * cols
        if w / h > current_w / current_h:
            current_h -= 2 * ((current_h - int(round(h * (current_w / w), 7))) // 2)
        else:
            current_w -= 2 * ((current_w - int(round(w * (current_h / h), 7))) // 2)
        unpadded, newline = current_h * current_w, current_h
        ratio = math.sqrt(current_h * current_w / (9 * 27**2))
        if ratio > 1.1:
            unpadded = int(current_h // ratio) * int(current_w // ratio)
            newline = int(current_h // ratio)
        assert ours.num_image_tokens(h, w) == 729 + unpadded + newline, (h, w)
        assert ours.num_image_tokens(h, w) == proc._get_number_of_features(h, w, 384, 384)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_onevision_parity(backend: str) -> None:
    rng = random.Random(f"{SEED}-{ONEVISION}-{backend}")
    for n_images in (1, 2, 3):
        check_case(ONEVISION, backend, n_images, rng.randrange(2**31), classic=n_images == 2)
    sizes = [(1080, 1920), (1, 3000), (2304, 384)]
    check_case(ONEVISION, backend, 3, SEED, sizes=sizes, classic=True)


def test_onevision_items_merge_into_hfs_batch() -> None:
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 900), photo_like(nrng, 1000, 700)]
    proc = hf_processor(ONEVISION, "pil")
    config = MultiModalConfig(transform="native", mm_device_do_normalize=True)
    ours = build_processor(ONEVISION, proc, config=config)
    alone = [ours.process_items({"image": [image]}, {})["image"][0] for image in images]
    assert [int(a.data["pixel_values"].shape[0]) for a in alone] == [4, 7]
    merged = merge_items(alone)
    ref = proc(
        text=[prompt_text(ONEVISION, 2)], images=images, return_tensors="pt",
        do_rescale=False, do_normalize=False,
    )  # fmt: skip
    assert torch.equal(merged["pixel_values"], ref["pixel_values"]), f"seed={SEED}"


def _clips(lengths: list[int], sizes: list[tuple[int, int]]) -> list[VideoClip]:
    return [
        VideoClip(frames_of(t, h, w, seed=t), 8.0, t, tuple(range(t)))
        for t, (h, w) in zip(lengths, sizes, strict=True)
    ]


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("device_normalize", [False, True])
def test_onevision_video_pixels_equal_hfs(backend: str, device_normalize: bool) -> None:
    """``pixel_values_videos`` of the native transform and of the HF transform (called as vLLM
    calls it: the images together, each video alone) equal ``LlavaOnevisionVideoProcessor``'s
    for each video, on both image backends (the video processor is torchvision's on both)."""
    proc = hf_processor(ONEVISION, backend)
    clips = _clips([5, 3, 2], [(50, 70), (384, 384), (500, 301)])
    image = np.array(photo_like(np.random.default_rng(SEED), 90, 120))
    extra = {"do_rescale": False, "do_normalize": False} if device_normalize else {}
    for transform in ("native", "hf"):
        config = MultiModalConfig(transform=transform, mm_device_do_normalize=device_normalize)
        ours = build_processor(ONEVISION, proc, config=config)
        items = ours.process_items({"image": [image], "video": clips}, {})
        for clip, item in zip(clips, items["video"], strict=True):
            ref = proc(text=["<video>"], videos=[clip.frames], return_tensors="pt", **extra)
            got = item.data["pixel_values_videos"]
            assert got.dtype == ref["pixel_values_videos"].dtype, (transform, backend)
            assert torch.equal(got, ref["pixel_values_videos"][0]), (transform, backend)
        ref = proc(text=["<image>"], images=[image], return_tensors="pt", **extra)
        got = items["image"][0].data["pixel_values"]
        assert torch.equal(got, ref["pixel_values"][0, : got.shape[0]]), (transform, backend)


def test_onevision_video_prompt_equals_hf_and_vllm() -> None:
    """``<video>`` becomes ``196 * frames + 1`` video tokens, all embeddings: vLLM's
    ``get_num_video_tokens`` (restated from ``vllm/model_executor/models/llava_onevision.py``:
    SigLIP's 27 x 27 patch grid pooled with stride 2, plus a newline) and HF's prompt."""
    proc = hf_processor(ONEVISION, "torchvision")
    ours = build_processor(ONEVISION, proc)
    pooled = math.ceil((384 // 14) / 2)
    for frames in (1, 2, 7, 32):
        assert ours.num_video_tokens(frames) == pooled * pooled * frames + 1 == 196 * frames + 1
    clip = _clips([3], [(40, 60)])[0]
    image = np.array(photo_like(np.random.default_rng(SEED), 70, 50))
    text = "<|im_start|>user <image><video>\nWhat?<|im_end|>"
    ref = proc(text=[text], images=[image], videos=[clip.frames], return_tensors="pt")
    prompt = proc.tokenizer(text)["input_ids"]
    out = ours.apply(prompt, {"image": [image], "video": [clip]})
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    (video,) = out.mm_placeholders["video"]
    assert video.length == 196 * 3 + 1 and video.is_embed is None
    assert (
        out.prompt_token_ids[video.offset : video.offset + video.length]
        == [ours.video_token_id] * video.length
    )


def test_onevision_videos_of_different_lengths_merge_into_a_list() -> None:
    """Videos of one length merge into ``[N, frames, 3, 384, 384]``; of different lengths into
    the list vLLM hands its model (the device stage's concatenation split again)."""
    ours = build_processor(ONEVISION)
    items = ours.process_items({"video": _clips([2, 3, 2], [(20, 30)] * 3)}, {})["video"]
    assert isinstance(items[0].fields["pixel_values_videos"], VideoFramesField)
    same = merge_items([items[0], items[2]])["pixel_values_videos"]
    assert same.shape == (2, 2, 3, 384, 384)
    mixed = merge_items(items)["pixel_values_videos"]
    assert [v.shape[0] for v in mixed] == [2, 3, 2]
    field = items[0].fields["pixel_values_videos"]
    values = [item.data["pixel_values_videos"] for item in items]
    parts = field.concat_parts(values)
    assert parts is not None and [p.shape[0] for p in parts] == [2, 3, 2]
    split = field.finish(torch.cat(parts), values)
    assert all(torch.equal(a, b) for a, b in zip(split, values, strict=True))


def test_onevision_takes_every_frame_and_plans_from_the_count() -> None:
    """HF's OneVision video processor samples no frame (``do_sample_frames`` off); a plan
    counts the tokens from the frame count."""
    ours = build_processor(ONEVISION)
    assert ours.supported_modalities == ("image", "video")
    assert ours.sample_frames(VideoInfo(45, 10.0, 8, 8), {}) == list(range(45))
    plan = ours.plan_video(SampledVideo(4, 30, 40, 8.0, 9, (0, 2, 5, 8)), {})
    clip = _clips([4], [(30, 40)])
    processed = ours.process_items({"video": clip}, {})
    ids = [1, ours.video_token_id, 2]
    planned = ours.assemble(ids, {"video": [plan]}, normalization=False)
    assert planned.prompt_token_ids == ours.assemble(ids, processed).prompt_token_ids


def test_vllm_default_loader_sampling() -> None:
    """vLLM's default ``"opencv"`` loader (LLaVA-OneVision's): ``min(32, total)`` frames,
    every one when that is all, else ``np.linspace(0, total - 1, n, dtype=int)`` (restated from
    ``VideoBackend.compute_frames_index_to_sample`` with ``num_frames=32``, ``fps=-1``); the
    metadata hashed names the ``"opencv"`` backend."""
    assert video_loader("LlavaOnevisionVideoProcessor") == "opencv"
    for total in (1, 2, 31, 32, 33, 34, 45, 77, 100, 1000, 54321):
        n = min(32, total)
        expected = list(range(total)) if n == total else [
            int(v) for v in np.linspace(0, total - 1, n, dtype=int)
        ]  # fmt: skip
        info = VideoInfo(total, 24.0, 8, 8)
        got = sample_indices_uniform(info)
        assert got == expected and len(set(got)) == len(got), total
        assert VllmDecoder(video_loader="opencv").sample_video(info) == got
    # an estimated count above the frames a reader gets: the frames past them are skipped
    info = VllmVideoInfo(40, 10.0, 8, 8, readable_frames=35)
    assert sample_indices_uniform(info)[-1] < 35
    meta = hash_metadata(VideoInfo(40, 10.0, 8, 8), [0, 39], "opencv")
    assert meta["video_backend"] == "opencv" and meta["do_sample_frames"] is False


@pytest.mark.anyio
async def test_onevision_videos_through_the_engine() -> None:
    """Two videos of different lengths and an image through the Engine equal ``apply`` (every
    frame: HF's rule), the videos a list; cached; with vLLM's loader (:class:`VllmDecoder`) a
    45-frame video gives 32 frames."""
    from aiomm.cache.item_cache import CacheOutcome
    from aiomm.config import DecodeConfig, EngineConfig
    from aiomm.engine import Engine
    from aiomm.media.video import decode_video
    from aiomm.types import Request

    videos = [make_video(frames_of(t, 40, 56, seed=t), rate=8) for t in (5, 9)]
    image = frames_of(1, 40, 52, seed=5)[0]
    config = EngineConfig(
        device="cpu", visual_dtype="float32", transform_threads=2, cache_capacity_bytes=64 << 20
    )
    proc = build_processor(ONEVISION, hf_processor(ONEVISION, "torchvision"))
    prompt = "<|im_start|>user <image><video><video>\nSay.<|im_end|>"
    ids = proc.hf_processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    clips = [decode_video(v, lambda i: proc.sample_frames(i, {})) for v in videos]
    out = proc.apply(ids, {"image": [image], "video": clips})
    merged = out.merged_kwargs()
    async with Engine(proc, config) as engine:
        request = Request(prompt=prompt, images=[image], videos=videos)
        first = await engine.process(request)
        second = await engine.process(request)
    for result in (first, second):
        assert result.ok, result.error
        assert result.prompt_token_ids == out.prompt_token_ids
        assert result.mm_placeholders == out.mm_placeholders
        got = result.mm_kwargs["pixel_values_videos"]
        assert [v.shape[0] for v in got] == [5, 9]
        for a, b in zip(got, merged["pixel_values_videos"], strict=True):
            assert torch.equal(a.cpu(), b)
    assert second.cache == [CacheOutcome.HIT] * 3
    decoder = VllmDecoder(DecodeConfig(), video_loader="opencv")
    long = make_video(frames_of(45, 24, 32, seed=3), rate=10)
    async with Engine(proc, config, decoder=decoder) as engine:
        result = await engine.process(Request(prompt="<video>", videos=[long]))
    assert result.ok, result.error
    assert result.mm_placeholders["video"][0].length == 196 * 32 + 1
