"""Qwen2-VL / Qwen2.5-VL video against transformers' ``Qwen2VLVideoProcessor``.

The reference is the HF processor given the *whole* decoded video and its metadata with
``do_sample_frames=True``: HF samples the frames itself, so the frame indices, the decode, the
transform, the grids, ``second_per_grid_ts`` and the expanded prompt are all checked at once
against aiomm's streamed decode of only the sampled frames.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from parity import hf_processor
from video_samples import CODECS, decode_all, frames_of, make_video

from aiomm.adapters import build_processor
from aiomm.adapters.qwen_vl import VIDEO_PLACEHOLDER, sample_frame_indices
from aiomm.errors import ProcessorKwargsError, UnknownModalityError
from aiomm.media.video import VideoClip, VideoInfo, clip_from_frames, decode_video, probe_video
from aiomm.processing.processor import MultiModalConfig

NAMES = ("qwen2-vl", "qwen2.5-vl")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
#: small pixel bounds keep the reference fast; one case runs the processor's defaults
SMALL = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}}


def _videos() -> list[tuple[bytes, str]]:
    """A video per codec (odd sizes where the codec takes them) and one of variable frame rate."""
    out = []
    for i, (codec, fmt, pix) in enumerate(CODECS):
        h, w = (37, 83) if pix == "yuv444p" else (64, 96)
        out.append((make_video(frames_of(11 + i, h, w, seed=i), codec, fmt, pix), codec))
    vfr = [0, 90, 130, 400, 430, 520, 700, 790, 810, 950, 1000, 1210, 1300]
    out.append((make_video(frames_of(13, 48, 80, seed=9), pts=vfr), "vfr"))
    return out


VIDEOS = _videos()


def _reference(proc: Any, text: str, videos: list[bytes], kwargs: dict[str, Any], **extra: Any):
    full = []
    for data in videos:
        info = probe_video(data)
        clip = decode_video(data, lambda i: range(i.total_num_frames))
        assert clip.frames.shape[0] == info.total_num_frames
        full.append(clip)
    return hf_processor_call(proc, text, full, kwargs, **extra)


def hf_processor_call(proc: Any, text: str, clips: list[VideoClip], kwargs: dict, **extra: Any):
    return proc.hf_processor(
        text=[text],
        videos=[c.frames for c in clips],
        video_metadata=[c.metadata() for c in clips],
        return_tensors="pt",
        **{"cap_pixels_per_frame": False, **kwargs},
        **extra,
    )


def _ours(proc: Any, prompt_ids: list[int], videos: list[bytes], kwargs: dict[str, Any]):
    clips = [decode_video(v, lambda i: proc.sample_frames(i, kwargs)) for v in videos]
    return proc.apply(prompt_ids, {"video": clips}, kwargs)


def _placeholders_from_ids(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of every run of ``token`` in HF's ``input_ids``."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("transform", ["native", "hf"])
def test_video_parity_uint8(name: str, backend: str, transform: str) -> None:
    """uint8 rows (device normalisation) equal HF's un-normalised output bit for bit."""
    proc = build_processor(
        name, hf_processor(name, backend), config=MultiModalConfig(transform=transform)
    )
    videos = [v for v, _ in VIDEOS]
    for kwargs in ({"do_sample_frames": True, "fps": 2.0, **SMALL},
                   {"do_sample_frames": True, "num_frames": 6, **SMALL}):  # fmt: skip
        text = "look " + " then ".join([VIDEO_PLACEHOLDER] * len(videos)) + " ok"
        ids = proc.hf_processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        ref = _reference(proc, text, videos, kwargs, do_rescale=False, do_normalize=False)
        got = _ours(proc, ids, videos, kwargs)
        merged = got.merged_kwargs()
        assert merged["pixel_values_videos"].dtype == torch.uint8
        assert torch.equal(merged["pixel_values_videos"].float(), ref["pixel_values_videos"])
        assert torch.equal(merged["video_grid_thw"], ref["video_grid_thw"])
        assert got.prompt_token_ids == ref["input_ids"][0].tolist()
        ranges = [(p.offset, p.length) for p in got.mm_placeholders["video"]]
        assert ranges == _placeholders_from_ids(got.prompt_token_ids, proc.video_token_id)
        assert len(ranges) == len(videos)
        if name == "qwen2.5-vl":
            assert torch.equal(merged["second_per_grid_ts"], ref["second_per_grid_ts"])
        else:
            assert "second_per_grid_ts" not in merged


@pytest.mark.parametrize("name", NAMES)
def test_video_parity_classic_and_defaults(name: str) -> None:
    """CPU-normalised floats equal HF's; the processor's default pixel bounds; images and
    videos in one prompt."""
    proc = build_processor(
        name, hf_processor(name), config=MultiModalConfig(mm_device_do_normalize=False)
    )
    videos = [VIDEOS[0][0], VIDEOS[2][0]]
    kwargs = {"do_sample_frames": True, "fps": 3.0}
    image = frames_of(1, 50, 70, seed=3)[0]
    text = f"a {IMAGE} b {VIDEO_PLACEHOLDER} c {VIDEO_PLACEHOLDER} d"
    ids = proc.hf_processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    clips = [decode_video(v, lambda i: proc.sample_frames(i, kwargs)) for v in videos]
    got = proc.apply(ids, {"image": [image], "video": clips}, kwargs)
    full = [decode_video(v, lambda i: range(i.total_num_frames)) for v in videos]
    ref = hf_processor_call(proc, text, full, kwargs, images=[image])
    merged = got.merged_kwargs()
    for key in ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"):
        assert torch.equal(merged[key], ref[key]), key
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()
    assert [p.offset for p in got.mm_placeholders["video"]] == [
        o for o, _ in _placeholders_from_ids(got.prompt_token_ids, proc.video_token_id)
    ]


@pytest.mark.parametrize("transform", ["native", "hf"])
def test_cap_pixels_per_frame(transform: str) -> None:
    """qwen-vl-utils' total pixel budget (``cap_pixels_per_frame``), where it bites."""
    hf = copy.deepcopy(hf_processor("qwen2-vl"))
    hf.video_processor.max_video_tokens = 10  # read from the processor, as HF reads it
    proc = build_processor("qwen2-vl", hf, config=MultiModalConfig(transform=transform))
    clip = clip_from_frames(frames_of(8, 64, 96), max_frames=8, max_bytes=1 << 24)
    ids = hf.tokenizer(VIDEO_PLACEHOLDER, add_special_tokens=False)["input_ids"]
    for cap in (False, True):
        kwargs = {"cap_pixels_per_frame": cap, **SMALL}
        got = proc.apply(ids, {"video": [clip]}, kwargs).merged_kwargs()
        ref = hf_processor_call(proc, VIDEO_PLACEHOLDER, [clip], kwargs,
                                do_rescale=False, do_normalize=False)  # fmt: skip
        assert torch.equal(got["video_grid_thw"], ref["video_grid_thw"])
        assert torch.equal(got["pixel_values_videos"].float(), ref["pixel_values_videos"])
        assert got["video_grid_thw"].tolist() == ([[4, 2, 4]] if cap else [[4, 4, 6]])


def test_frames_in_memory_match_hf() -> None:
    """A list of frames (no frame rate): HF's default metadata, ``second_per_grid_ts`` at 24 fps,
    an odd frame count padded with the last frame."""
    proc = build_processor("qwen2.5-vl", hf_processor("qwen2.5-vl"))
    frames = frames_of(5, 40, 60, seed=4)
    clip = clip_from_frames(list(frames), max_frames=10, max_bytes=1 << 20)
    ids = proc.hf_processor.tokenizer(VIDEO_PLACEHOLDER, add_special_tokens=False)["input_ids"]
    got = proc.apply(ids, {"video": [clip]}, SMALL)
    ref = proc.hf_processor(
        text=[VIDEO_PLACEHOLDER], videos=[frames], do_rescale=False, do_normalize=False,
        cap_pixels_per_frame=False, return_tensors="pt", **SMALL,
    )  # fmt: skip
    merged = got.merged_kwargs()
    assert torch.equal(merged["pixel_values_videos"].float(), ref["pixel_values_videos"])
    assert merged["video_grid_thw"].tolist() == [[3, *ref["video_grid_thw"][0, 1:].tolist()]]
    assert torch.equal(merged["second_per_grid_ts"], ref["second_per_grid_ts"])
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()


def test_temporal_patches_hold_consecutive_frames() -> None:
    """Each row holds two different real frames (not one frame repeated, as images do)."""
    proc = build_processor("qwen2-vl", hf_processor("qwen2-vl"))
    frames = np.zeros((4, 56, 56, 3), np.uint8)
    for t in range(4):
        frames[t] = 10 * (t + 1)
    clip = clip_from_frames(frames, max_frames=4, max_bytes=1 << 20)
    item = proc.process_items({"video": [clip]}, SMALL)["video"][0]
    rows = item.data["pixel_values_videos"]
    p2 = 14 * 14
    # rows of the first temporal patch: channel 0 holds frame 0 then frame 1
    first = rows[0, : 2 * p2]
    assert set(first[:p2].tolist()) == {10} and set(first[p2:].tolist()) == {20}
    assert item.data["video_grid_thw"].tolist() == [2, 4, 4]


def test_sampling_indices_equal_hf() -> None:
    """``sample_frame_indices`` equals ``Qwen2VLVideoProcessor.sample_frames`` everywhere."""
    from transformers.video_utils import VideoMetadata

    vp = hf_processor("qwen2-vl").video_processor
    for total in (4, 7, 12, 33, 100, 301):
        for video_fps in (7.0, 8.0, 24.0, 29.97):
            info = VideoInfo(total, video_fps, 10, 10)
            meta = VideoMetadata(total_num_frames=total, fps=video_fps)
            for kwargs in ({"fps": 1.0}, {"fps": 2.0}, {"fps": 5.5}, {"num_frames": 4},
                           {"num_frames": total}, {"fps": 2.0, "min_frames": 8, "max_frames": 16},
                           {"fps": 30.0, "max_frames": 20}):  # fmt: skip
                try:
                    want = vp.sample_frames(metadata=meta, **kwargs).tolist()
                except ValueError:
                    with pytest.raises(ProcessorKwargsError):
                        _indices(vp, info, kwargs)
                    continue
                assert _indices(vp, info, kwargs) == want, (total, video_fps, kwargs)


def _indices(vp: Any, info: VideoInfo, kwargs: dict[str, Any]) -> list[int]:
    return sample_frame_indices(
        info,
        do_sample_frames=True,
        fps=kwargs.get("fps"),
        num_frames=kwargs.get("num_frames"),
        min_frames=kwargs.get("min_frames", vp.min_frames),
        max_frames=kwargs.get("max_frames", vp.max_frames),
        temporal_patch_size=vp.temporal_patch_size,
    )


def test_sampling_off_keeps_every_frame_and_kwargs_are_checked() -> None:
    proc = build_processor("qwen2-vl", hf_processor("qwen2-vl"))
    info = VideoInfo(9, 8.0, 10, 10)
    assert proc.sample_frames(info, {}) == list(range(9))  # the processor's default: off
    with pytest.raises(ProcessorKwargsError, match="mutually exclusive"):
        proc.sample_frames(info, {"do_sample_frames": True, "fps": 1.0, "num_frames": 4})
    with pytest.raises(ProcessorKwargsError, match="frame rate"):
        proc.sample_frames(VideoInfo(9, None, 10, 10), {"do_sample_frames": True, "fps": 1.0})
    assert "fps" in proc.allowed_hf_kwargs() and "video_metadata" not in proc.allowed_hf_kwargs()
    clip = clip_from_frames(frames_of(2, 32, 32), max_frames=4, max_bytes=1 << 20)
    with pytest.raises(ProcessorKwargsError, match="pass size="):
        proc.process_items({"video": [clip]}, {"min_pixels": 56 * 56})


def test_an_image_only_processor_refuses_video() -> None:
    """Mistral 3's processor takes no video: neither does its adapter."""
    proc = build_processor("mistral3", hf_processor("mistral3"))
    clip = clip_from_frames(frames_of(2, 32, 32), max_frames=4, max_bytes=1 << 20)
    with pytest.raises(UnknownModalityError):
        proc.apply([1, 2], {"video": [clip]})


def test_streamed_decode_equals_full_decode() -> None:
    for data, codec in VIDEOS:
        full = decode_all(data)
        clip = decode_video(data, lambda i: [0, 2, i.total_num_frames - 1])
        assert np.array_equal(clip.frames, full[[0, 2, len(full) - 1]]), codec
        assert clip.total_num_frames == len(full), codec
