"""Videos whose prompt carries frame timestamps: Qwen3-VL (``Qwen3VLVideoProcessor``) and the
GLM-V family (``Glm4vVideoProcessor``, GLM-OCR's ``Glm46VVideoProcessor``,
``Glm5NextVideoProcessor``) against transformers.

The reference is the HF processor given the *whole* decoded video and its metadata: HF samples the
frames itself, so the frame indices, the streamed decode, the transform, the grids, the timestamps
and the expanded prompt are checked at once. The HF processors here carry a tokenizer that knows
digits and punctuation (split as real BPE tokenizers split them), so the timestamp texts are real
token ids, not unknown tokens.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest
import torch
from parity import hf_processor
from video_samples import CODECS, frames_of, make_video

from aiomm.adapters import build_processor
from aiomm.adapters.glm import (
    GLM_SPECIAL_TOKENS,
    glm4v_sample_frame_indices,
    glm5_next_sample_frame_indices,
    glm46v_sample_frame_indices,
)
from aiomm.adapters.glm import VIDEO_PLACEHOLDER as GLM_VIDEO
from aiomm.adapters.offline import PROMPT_WORDS
from aiomm.adapters.qwen_vl import QWEN_SPECIAL_TOKENS, qwen3_sample_frame_indices
from aiomm.adapters.qwen_vl import VIDEO_PLACEHOLDER as QWEN_VIDEO
from aiomm.cache.codec import decode_item, encode_item
from aiomm.errors import DecodeError, ProcessingError, ProcessorKwargsError
from aiomm.media.video import VideoInfo, clip_from_frames, decode_video
from aiomm.processing.processor import MultiModalConfig

NAMES = ("qwen3-vl", "glm-4v", "glm-ocr", "glm-5-next")
#: per adapter: its video placeholder, the tokens around an expansion, an image placeholder
PROMPTS = {
    "qwen3-vl": (QWEN_VIDEO, "<|vision_start|>", "<|vision_end|>",
                 "<|vision_start|><|image_pad|><|vision_end|>"),
    "glm-4v": (GLM_VIDEO, "<|begin_of_video|>", "<|end_of_video|>",
               "<|begin_of_image|><|image|><|end_of_image|>"),
}  # fmt: skip
PROMPTS["glm-ocr"] = PROMPTS["glm-5-next"] = PROMPTS["glm-4v"]
#: small pixel bounds (they count every frame of a video) keep the reference fast
SMALL = {
    "qwen3-vl": {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}},
    "glm-4v": {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}},
}
SMALL["glm-ocr"] = SMALL["glm-4v"]
#: GLM-5-Next's budget is in tokens of ``temporal_patch_size * 28**2`` pixels
SMALL["glm-5-next"] = {"min_image_tokens": 4, "max_image_tokens": 40}
#: the sampling kwargs each video processor reads (GLM-4.6V's rate follows the duration)
SAMPLINGS = {
    "qwen3-vl": ({}, {"fps": 3.0}, {"fps": None, "num_frames": 5}, {"do_sample_frames": False}),
    "glm-4v": ({}, {"fps": 3.0}, {"do_sample_frames": False}),
    "glm-ocr": ({}, {"do_sample_frames": False}),
    "glm-5-next": ({}, {"fps": 3.0}, {"do_sample_frames": False}),
}


def _videos() -> list[bytes]:
    """A video per codec (odd sizes where the codec takes them) and one of variable frame rate."""
    out = []
    for i, (codec, fmt, pix) in enumerate(CODECS):
        h, w = (37, 83) if pix == "yuv444p" else (64, 96)
        out.append(make_video(frames_of(11 + i, h, w, seed=i), codec, fmt, pix))
    vfr = [0, 90, 130, 400, 430, 520, 700, 790, 810, 950, 1000, 1210, 1300]
    out.append(make_video(frames_of(13, 48, 80, seed=9), pts=vfr))
    return out


VIDEOS = _videos()


def _number_tokenizer(special_tokens: tuple[str, ...]) -> Any:
    """A word-level tokenizer that also knows digits, ``.``, ``<``, ``>`` and ``seconds``,
    splitting punctuation and single digits as byte-level BPE tokenizers do."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*PROMPT_WORDS, *"0123456789", ".", "<", ">", "seconds"]
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
        pre_tokenizers.Digits(individual_digits=True),
    ])  # fmt: skip
    specials = list(dict.fromkeys(["<|endoftext|>", *special_tokens]))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>"
    )


@functools.cache
def _hf(name: str, backend: str = "torchvision") -> Any:
    """The HF processor of ``name`` (its image processor of ``backend``; the video processors
    have only a torchvision backend) with the number-aware tokenizer."""
    base = hf_processor(name, backend)
    specials = QWEN_SPECIAL_TOKENS if name.startswith("qwen") else GLM_SPECIAL_TOKENS
    return type(base)(
        image_processor=base.image_processor,
        tokenizer=_number_tokenizer(specials),
        video_processor=base.video_processor,
    )


def _processor(name: str, backend: str = "torchvision", **config: Any) -> Any:
    return build_processor(name, _hf(name, backend), config=MultiModalConfig(**config))


def _sampled(proc: Any, videos: list[bytes], kwargs: dict[str, Any]) -> list[Any]:
    """aiomm's streamed decode of the frames the adapter samples."""
    return [decode_video(v, lambda i: proc.sample_frames(i, kwargs)) for v in videos]


def _full(videos: list[bytes]) -> list[Any]:
    return [decode_video(v, lambda i: range(i.total_num_frames)) for v in videos]


def _hf_call(proc: Any, text: str, videos: list[Any], **kwargs: Any) -> Any:
    # Qwen3-VL: the cap's default is about to change (HF warns); GLM-V: its token type ids
    # warn under numpy 2 (the expected mask is computed from input_ids instead)
    qwen = proc.hf_processor.video_processor.__class__.__name__.startswith("Qwen")
    extra = {"cap_pixels_per_frame": False} if qwen else {"return_mm_token_type_ids": False}
    return proc.hf_processor(text=[text], videos=videos, return_tensors="pt", **{**extra, **kwargs})


def _reference(proc: Any, text: str, videos: list[bytes], kwargs: dict[str, Any], **extra: Any):
    clips = _full(videos)
    return _hf_call(proc, text, [c.frames for c in clips],
                    video_metadata=[c.metadata() for c in clips], **kwargs, **extra)  # fmt: skip


def _ids(proc: Any, text: str) -> list[int]:
    return proc.hf_processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _video_embeds(name: str, proc: Any, ids: list[int]) -> list[bool]:
    """The tokens HF's ``mm_token_type_ids`` types as video (2): Qwen3-VL's ``<|video_pad|>``;
    GLM-V's ``<|image|>`` between ``<|begin_of_video|>`` and ``<|end_of_video|>``."""
    if name.startswith("qwen"):
        return [t == proc.video_token_id for t in ids]
    tok = proc.hf_processor.tokenizer
    begin, end = (tok.convert_tokens_to_ids(t) for t in PROMPTS[name][1:3])
    out, inside = [], False
    for t in ids:
        inside = True if t == begin else False if t == end else inside
        out.append(inside and t == proc.image_token_id)
    return out


def _check_placeholders(name: str, proc: Any, got: Any, count: int) -> None:
    """Each range spans one video's whole expansion (between the tokens around its
    placeholder); ``is_embed`` marks exactly the tokens HF types as video tokens."""
    _, start, end, _ = PROMPTS[name]
    tok = proc.hf_processor.tokenizer
    start_id, end_id = tok.convert_tokens_to_ids(start), tok.convert_tokens_to_ids(end)
    ids = got.prompt_token_ids
    embeds = _video_embeds(name, proc, ids)
    ranges = got.mm_placeholders["video"]
    assert len(ranges) == count
    for r in ranges:
        assert ids[r.offset - 1] == start_id and ids[r.offset + r.length] == end_id
        assert list(r.is_embed) == embeds[r.offset : r.offset + r.length]
        assert not all(r.is_embed)  # timestamps and frame delimiters are text
    assert sum(r.embed_count for r in ranges) == sum(embeds)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("transform", ["native", "hf"])
def test_video_parity_uint8(name: str, transform: str) -> None:
    """uint8 rows (device normalisation) equal HF's un-normalised output bit for bit; the
    prompt (timestamps included) equals HF's ``input_ids``."""
    proc = _processor(name, transform=transform)
    placeholder = PROMPTS[name][0]
    for sampling in SAMPLINGS[name]:
        kwargs = {**sampling, **SMALL[name]}
        text = "look " + " then ".join([placeholder] * len(VIDEOS)) + " ok"
        ref = _reference(proc, text, VIDEOS, kwargs, do_rescale=False, do_normalize=False)
        clips = _sampled(proc, VIDEOS, kwargs)
        got = proc.apply(_ids(proc, text), {"video": clips}, kwargs)
        merged = got.merged_kwargs()
        assert merged["pixel_values_videos"].dtype == torch.uint8
        assert torch.equal(merged["pixel_values_videos"].float(), ref["pixel_values_videos"])
        assert torch.equal(merged["video_grid_thw"], ref["video_grid_thw"])
        assert set(merged) == {"pixel_values_videos", "video_grid_thw"}  # timestamps: no kwarg
        assert got.prompt_token_ids == ref["input_ids"][0].tolist(), sampling
        _check_placeholders(name, proc, got, len(VIDEOS))
    # the timestamps are real text: one per temporal patch, digits included
    decoded = proc.hf_processor.tokenizer.decode(got.prompt_token_ids)
    assert any(d in decoded for d in "123456789")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_video_parity_classic_with_an_image(name: str, backend: str) -> None:
    """CPU-normalised floats equal HF's; an image and two videos in one prompt, with either
    image processor backend."""
    proc = _processor(name, backend, mm_device_do_normalize=False)
    video, _, _, image_ph = PROMPTS[name]
    kwargs = dict(SMALL[name])
    image = frames_of(1, 50, 70, seed=3)[0]
    videos = [VIDEOS[0], VIDEOS[3]]
    text = f"a {image_ph} b {video} c {video} d"
    clips = _sampled(proc, videos, kwargs)
    got = proc.apply(_ids(proc, text), {"image": [image], "video": clips}, kwargs)
    ref = _reference(proc, text, videos, kwargs, images=[image])
    merged = got.merged_kwargs()
    for key in ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"):
        assert torch.equal(merged[key], ref[key]), key
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()
    _check_placeholders(name, proc, got, 2)
    assert len(got.mm_placeholders["image"]) == 1


def test_frames_in_memory_match_hf() -> None:
    """Frames without a rate: Qwen3-VL samples and stamps them at HF's 24 fps; GLM-V cannot
    sample them by time (a typed error) but takes them all with ``do_sample_frames=False``."""
    frames = frames_of(30, 40, 60, seed=4)
    clip = clip_from_frames(list(frames), max_frames=64, max_bytes=1 << 24)
    for name, kwargs in (("qwen3-vl", {}), ("glm-4v", {"do_sample_frames": False})):
        proc = _processor(name)
        kwargs = {**kwargs, **SMALL[name]}
        text = PROMPTS[name][0]
        indices = proc.sample_frames(VideoInfo(30, None, 40, 60), kwargs)
        sampled = clip_from_frames(frames[indices], max_frames=64, max_bytes=1 << 24)
        sampled = type(sampled)(sampled.frames, None, 30, tuple(indices))
        got = proc.apply(_ids(proc, text), {"video": [sampled]}, kwargs)
        ref = _hf_call(proc, text, [frames], do_rescale=False, do_normalize=False, **kwargs)
        assert torch.equal(got.merged_kwargs()["pixel_values_videos"].float(),
                           ref["pixel_values_videos"])  # fmt: skip
        assert got.prompt_token_ids == ref["input_ids"][0].tolist(), name
    assert len(indices) == 30  # do_sample_frames=False: every frame
    glm = _processor("glm-4v")
    with pytest.raises(ProcessorKwargsError, match="frame rate"):
        glm.sample_frames(VideoInfo(clip.total_num_frames, None, 40, 60), {})


def test_sampling_indices_equal_hf() -> None:
    """The three samplers equal the HF video processors' ``sample_frames`` everywhere."""
    from transformers.video_utils import VideoMetadata

    qwen3 = _hf("qwen3-vl").video_processor
    glm4v = _hf("glm-4v").video_processor
    glm46v = _hf("glm-ocr").video_processor
    glm5 = _hf("glm-5-next").video_processor
    for total in (2, 5, 12, 33, 100, 301, 2000):
        for video_fps in (7.0, 8.0, 24.0, 29.97):
            info = VideoInfo(total, video_fps, 10, 10)

            def meta(total: int = total, video_fps: float = video_fps) -> VideoMetadata:
                return VideoMetadata(total_num_frames=total, fps=video_fps,
                                     duration=total / video_fps)  # fmt: skip

            for kw in ({"fps": 2.0}, {"fps": 0.5}, {"fps": 5.5}, {"fps": None, "num_frames": 4},
                       {"fps": None, "num_frames": total + 3}, {"fps": None}):  # fmt: skip
                want = qwen3.sample_frames(metadata=meta(), **kw).tolist()
                got = qwen3_sample_frame_indices(
                    info, do_sample_frames=True, fps=kw["fps"], num_frames=kw.get("num_frames"),
                    min_frames=qwen3.min_frames, max_frames=qwen3.max_frames,
                    default_fps=qwen3.fps,
                )  # fmt: skip
                assert got == want, (total, video_fps, kw)
            for fps in (0.5, 2.0, 3.0):
                want = glm4v.sample_frames(metadata=meta(), fps=fps).tolist()
                got = glm4v_sample_frame_indices(info, fps=fps, max_duration=glm4v.max_duration)
                assert got == want, (total, video_fps, fps)
                for max_duration in (0, 7):  # the processor's (none), and a cap
                    vp = copy.copy(glm5)
                    vp.max_duration = max_duration
                    want = vp.sample_frames(metadata=meta(), fps=fps).tolist()
                    got = glm5_next_sample_frame_indices(
                        info, fps=fps, max_duration=max_duration, max_frames=vp.max_frames
                    )
                    assert got == want, (total, video_fps, fps, max_duration)
            want = glm46v.sample_frames(metadata=meta()).tolist()
            got = glm46v_sample_frame_indices(info, temporal_patch_size=2)
            assert got == want, (total, video_fps)
    with pytest.raises(ProcessorKwargsError, match="mutually exclusive"):
        _processor("qwen3-vl").sample_frames(VideoInfo(9, 8.0, 10, 10), {"num_frames": 4})


def test_repeated_frames_decode_and_going_back_is_refused() -> None:
    """A sampler may repeat a frame (GLM-V's even count): decoded once, written twice."""
    data = VIDEOS[0]
    full = _full([data])[0].frames
    clip = decode_video(data, lambda _: [0, 4, 8, 8])
    assert np.array_equal(clip.frames, full[[0, 4, 8, 8]])
    with pytest.raises(DecodeError, match="must not decrease"):
        decode_video(data, lambda _: [0, 4, 3])


def test_one_frame_is_refused_as_hf_does() -> None:
    proc = _processor("qwen3-vl")
    clip = clip_from_frames(frames_of(1, 40, 40), max_frames=4, max_bytes=1 << 20)
    with pytest.raises(ProcessingError, match="shorter than temporal_patch_size"):
        proc.process_items({"video": [clip]}, {"do_sample_frames": False, **SMALL["qwen3-vl"]})


@pytest.mark.parametrize("name", ["qwen3-vl", "glm-4v"])
def test_timestamps_survive_the_shared_cache_codec(name: str) -> None:
    """An item read back from its bytes expands the prompt exactly as the fresh one."""
    proc = _processor(name)
    kwargs = dict(SMALL[name])
    clip = decode_video(VIDEOS[1], lambda i: proc.sample_frames(i, kwargs))
    item = proc.process_items({"video": [clip]}, kwargs)["video"][0]
    assert item.prompt_data["timestamps"]
    back = decode_item(encode_item(item))
    assert back.prompt_data == item.prompt_data
    ids = _ids(proc, PROMPTS[name][0])
    fresh = proc.assemble(ids, {"video": [item]}, kwargs)
    cached = proc.assemble(ids, {"video": [back]}, kwargs)
    assert cached.prompt_token_ids == fresh.prompt_token_ids
    assert cached.mm_placeholders == fresh.mm_placeholders


@pytest.mark.parametrize("name", NAMES)
def test_a_video_processor_normalising_otherwise_is_refused_on_the_device(name: str) -> None:
    """The device normalises images and videos alike: a checkpoint whose video processor has
    its own mean is refused there (a typed error), and served by the classic path."""
    base = _hf(name)
    video = copy.deepcopy(base.video_processor)
    video.image_mean = [0.25, 0.25, 0.25]
    hf = type(base)(
        image_processor=base.image_processor, tokenizer=base.tokenizer, video_processor=video
    )
    kwargs = {"do_sample_frames": False, **SMALL[name]}
    clip = clip_from_frames(frames_of(4, 40, 60), max_frames=4, max_bytes=1 << 20)
    with pytest.raises(ProcessingError, match="mm_device_do_normalize=False"):
        build_processor(name, hf).process_items({"video": [clip]}, kwargs)
    classic = build_processor(name, hf, config=MultiModalConfig(mm_device_do_normalize=False))
    got = classic.process_items({"video": [clip]}, kwargs)["video"][0]
    ref = _hf_call(classic, PROMPTS[name][0], [clip.frames], **kwargs)
    assert torch.equal(got.data["pixel_values_videos"], ref["pixel_values_videos"])


def test_the_item_codec_refuses_bad_prompt_data() -> None:
    from aiomm.errors import CacheValueError

    proc = _processor("qwen3-vl")
    clip = clip_from_frames(frames_of(2, 40, 40), max_frames=4, max_bytes=1 << 20)
    item = proc.process_items({"video": [clip]}, {"do_sample_frames": False, **SMALL["qwen3-vl"]})
    item = item["video"][0]
    assert item.prompt_data == {"timestamps": [1 / 48]}  # frames 0 and 1 at HF's default 24 fps
    item.prompt_data["timestamps"] = [float("nan")]
    with pytest.raises(CacheValueError, match="prompt data"):
        encode_item(item)


@pytest.mark.parametrize("transform", ["native", "hf"])
def test_qwen3_cap_pixels_per_frame(transform: str) -> None:
    """Qwen3-VL's own per-frame cap (``max_video_tokens``, its formula, not Qwen2-VL's), where
    it bites."""
    base = _hf("qwen3-vl")
    video = copy.deepcopy(base.video_processor)
    video.max_video_tokens = 4  # read from the processor, as HF reads it
    hf = type(base)(
        image_processor=base.image_processor, tokenizer=base.tokenizer, video_processor=video
    )
    proc = build_processor("qwen3-vl", hf, config=MultiModalConfig(transform=transform))
    clip = clip_from_frames(frames_of(8, 64, 96), max_frames=8, max_bytes=1 << 24)
    grids = []
    for cap in (False, True):
        kwargs = {"do_sample_frames": False, "cap_pixels_per_frame": cap, **SMALL["qwen3-vl"]}
        got = proc.apply(_ids(proc, QWEN_VIDEO), {"video": [clip]}, kwargs)
        ref = _hf_call(proc, QWEN_VIDEO, [clip.frames], do_rescale=False, do_normalize=False,
                       **kwargs)  # fmt: skip
        merged = got.merged_kwargs()
        assert torch.equal(merged["video_grid_thw"], ref["video_grid_thw"])
        assert torch.equal(merged["pixel_values_videos"].float(), ref["pixel_values_videos"])
        assert got.prompt_token_ids == ref["input_ids"][0].tolist()
        grids.append(merged["video_grid_thw"].tolist())
    assert grids[0] != grids[1]
