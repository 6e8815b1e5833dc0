"""Qwen3-Omni cases beyond the parity harness (which covers its images on both backends): audio
against the HF processor as vLLM 0.33 calls it (clips pre-padded to the hop, one ``"longest"``
batch per request) and post-processes it, clips processed one by one and assembled into a
request, images, videos and audio in one request, the token rule, the folder and the refusals."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from parity import SEED, hf_processor
from video_samples import noise_clip

from aiomm.adapters import build_processor
from aiomm.adapters.qwen3_omni import (
    AUDIO_END,
    AUDIO_START,
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    QWEN3_OMNI_FEATURE_PARAMS,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    audio_output_length,
    pad_to_hop,
)
from aiomm.cache.codec import decode_item, encode_item
from aiomm.errors import ItemRejectedError, ProcessorKwargsError
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig

NAME = "qwen3-omni"
RATE, HOP = 16000, 160
AUDIO = AUDIO_START + AUDIO_TOKEN + AUDIO_END
IMAGE = VISION_START + IMAGE_TOKEN + VISION_END
VIDEO = VISION_START + VIDEO_TOKEN + VISION_END
AUDIO_KEYS = ("input_audio_features", "audio_feature_lengths")


def _vllm_reference(proc: Any, text: str, audio: list[np.ndarray], **data: Any) -> dict[str, Any]:
    """The HF processor as vLLM's Qwen3-Omni processor calls it (each clip padded with zeros to
    a multiple of the hop, all of them in one call, ``truncation=False``), then its
    ``_postprocess_hf_mm_data``: each clip's own frames flat along dim 1, one float32 mask of
    ones and a length per clip."""
    padded = [pad_to_hop(clip, HOP) for clip in audio]
    out = dict(proc(text=[text], audio=padded, **data, truncation=False, return_tensors="pt"))
    mask = out.pop("feature_attention_mask")
    features = out.pop("input_features")
    out["input_audio_features"] = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
    frames = [clip.shape[0] // HOP for clip in padded]
    out["audio_feature_lengths"] = torch.tensor(frames)
    out["feature_attention_mask"] = [torch.ones(n) for n in frames]
    if "video_second_per_grid" in out:
        out["second_per_grid_ts"] = torch.as_tensor(out.pop("video_second_per_grid"))
    return out


def _clip(rng: np.random.Generator, samples: int, loud_end: bool = False) -> np.ndarray:
    clip = (0.2 * rng.standard_normal(samples)).astype(np.float32)
    if loud_end:
        # the dynamic-range clamp's peak in the last frame: a batch's padding moves it
        clip[-min(samples, 60) :] *= 25
    return clip


def _assert_audio_equal(merged: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    for key in AUDIO_KEYS:
        assert merged[key].dtype == ref[key].dtype, f"{where}: {key}"
        assert torch.equal(merged[key], ref[key]), f"{where}: {key}"
    masks = merged["feature_attention_mask"]
    masks = list(masks) if isinstance(masks, torch.Tensor) else masks
    assert len(masks) == len(ref["feature_attention_mask"]), where
    for got, want in zip(masks, ref["feature_attention_mask"], strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want), where


def test_the_token_count_is_the_processors_for_every_feature_length() -> None:
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    lengths = torch.arange(1, 30101)
    want = _get_feat_extract_output_lengths(lengths)
    assert torch.equal(audio_output_length(lengths), want)  # type: ignore[arg-type]
    assert audio_output_length(100) == 13 and audio_output_length(1) == 1


def test_the_reference_has_the_checkpoints_feature_extractor() -> None:
    extractor = hf_processor(NAME).feature_extractor
    for key, value in QWEN3_OMNI_FEATURE_PARAMS.items():
        if key != "return_attention_mask":
            assert getattr(extractor, key) == value, key


#: clip lengths in samples, chosen to cross what changes a clip's features in a batch: equal
#: lengths, one hop apart, far apart, tiny clips alone and together (every clip under 12 frames:
#: another sgemm path), a clip of at most 160 samples beside a longer one
BATCHES = [
    (16000,),
    (35,),  # at most 160 samples alone: refused as HF's STFT refuses it
    (161,),
    (1900,),
    (16000, 16000),
    (16000, 16160),
    (16001, 16161),
    (8000, 112000),
    (700, 1500),
    (100, 1700),
    (100, 32000),
    (170, 330, 490, 1760),
    (160, 160),
    (1760, 1921, 40000, 3),
]


@pytest.mark.parametrize("lengths", BATCHES, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("loud_end", [False, True], ids=["plain", "loud_end"])
def test_a_requests_clips_equal_vllms_batched_call(
    lengths: tuple[int, ...], loud_end: bool
) -> None:
    """``apply`` on the request's clips, and the clips processed one by one (the engine and its
    cache) then assembled, equal the one HF call vLLM makes, bit for bit, on both transforms."""
    rng = np.random.default_rng(SEED + sum(lengths) + loud_end)
    proc = hf_processor(NAME)
    clips = [_clip(rng, n, loud_end) for n in lengths]
    text = "user " + " ".join([AUDIO] * len(clips)) + " assistant"
    prompt_ids = proc.tokenizer(text)["input_ids"]
    try:
        ref: dict[str, Any] | None = _vllm_reference(proc, text, clips)
    except RuntimeError:  # torch.stft: "Padding size should be less than ..."
        ref = None
    for mode in ("hf", "native"):
        ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
        where = f"{mode} {lengths} loud_end={loud_end} seed={SEED}"
        if ref is None:
            with pytest.raises(ItemRejectedError, match="too short for the feature extractor"):
                ours.apply(prompt_ids, {"audio": clips})
            continue
        out = ours.apply(prompt_ids, {"audio": clips})
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), where
        _assert_audio_equal(out.merged_kwargs(), ref, where)
        # one by one, each through the cache codec, then assembled
        items = [
            decode_item(encode_item(ours.process_items({"audio": [c]}, {})["audio"][0]))
            for c in clips
        ]
        one_by_one = ours.assemble(prompt_ids, {"audio": items})
        assert one_by_one.prompt_token_ids == ref["input_ids"][0].tolist(), where
        _assert_audio_equal(one_by_one.merged_kwargs(), ref, f"{where} one by one")


def test_random_requests_equal_vllms_batched_call() -> None:
    """Seeded random requests of one to four clips from 1 sample to 4 s."""
    rng = np.random.default_rng(SEED)
    proc = hf_processor(NAME)
    ours = build_processor(NAME, proc)
    checked = 0
    for _ in range(40):
        lengths = [
            int(
                rng.choice(
                    [rng.integers(1, 400), rng.integers(400, 2200), rng.integers(2200, 64000)]
                )
            )
            for _ in range(int(rng.integers(1, 5)))
        ]
        clips = [_clip(rng, n, bool(rng.random() < 0.5)) for n in lengths]
        text = "user " + " ".join([AUDIO] * len(clips)) + " assistant"
        try:
            ref = _vllm_reference(proc, text, clips)
        except RuntimeError:
            with pytest.raises(ItemRejectedError):
                ours.apply(proc.tokenizer(text)["input_ids"], {"audio": clips})
            continue
        out = ours.apply(proc.tokenizer(text)["input_ids"], {"audio": clips})
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), lengths
        _assert_audio_equal(out.merged_kwargs(), ref, f"{lengths} seed={SEED}")
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_images_videos_and_audio_in_one_request_equal_the_reference(backend: str) -> None:
    rng = np.random.default_rng(SEED)
    proc = hf_processor(NAME, backend)
    images = [photo_like(rng, 100, 150), photo_like(rng, 333, 500)]
    clips = [_clip(rng, n) for n in (RATE * 3, 5000)]
    video = noise_clip(rng, 4, 90, 160)
    text = f"user {IMAGE} hear {AUDIO} {VIDEO} then {AUDIO} and {IMAGE} assistant"
    ref = _vllm_reference(
        proc, text, clips, images=images, videos=[video.frames],
        videos_kwargs={"do_sample_frames": False, "cap_pixels_per_frame": False},
    )  # fmt: skip
    ref_ids = ref["input_ids"][0].tolist()
    prompt_ids = proc.tokenizer(text)["input_ids"]
    for mode in ("hf", "native"):
        ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"image": images, "audio": clips, "video": [video]})
        where = f"{backend} {mode} seed={SEED}"
        assert out.prompt_token_ids == ref_ids, where
        merged = out.merged_kwargs()
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                    "second_per_grid_ts"):  # fmt: skip
            assert merged[key].dtype == ref[key].dtype, f"{where}: {key}"
            assert torch.equal(merged[key], ref[key]), f"{where}: {key}"
        _assert_audio_equal(merged, ref, where)
        assert merged["use_audio_in_video"].item() is False


def test_videos_take_qwen3_omnis_pixel_bounds_and_seconds() -> None:
    """A frame resizes within 128 to 768 merged 32-px patches, and ``second_per_grid_ts`` is
    2 / fps with fps the request's or 1."""
    ours = build_processor(NAME)
    rng = np.random.default_rng(SEED)
    small, large = noise_clip(rng, 2, 32, 32), noise_clip(rng, 2, 1080, 1920)
    items = ours.process_items({"video": [small, large]}, {})["video"]
    grids = [item.data["video_grid_thw"].tolist() for item in items]
    merged_patches = [h * w // 4 for _, h, w in grids]
    assert merged_patches[0] >= 128 and merged_patches[1] <= 768, grids
    assert [float(item.data["second_per_grid_ts"]) for item in items] == [2.0, 2.0]
    items = ours.process_items({"video": [small]}, {"fps": 4.0})["video"]
    assert float(items[0].data["second_per_grid_ts"]) == 0.5


def test_items_keep_what_a_batch_changes() -> None:
    """An item holds its clip's frames alone and, as JSON, what a batch's padding changes; a
    tiny clip also its samples."""
    ours = build_processor(NAME)
    rng = np.random.default_rng(SEED)
    (long,) = ours.process_items({"audio": [_clip(rng, RATE)]}, {})["audio"]
    assert tuple(long.data["input_audio_features"].shape) == (128, 100)
    assert tuple(long.data["feature_attention_mask"].shape) == (100,)
    assert long.data["feature_attention_mask"].dtype == torch.float32
    assert set(long.prompt_data) == {"padded", "alone"} and long.prompt_data["alone"] is True
    assert all(len(v["last"]) == 128 for v in long.prompt_data["padded"].values())
    json.dumps(long.prompt_data)
    (tiny,) = ours.process_items({"audio": [_clip(rng, 100)]}, {})["audio"]
    assert tiny.prompt_data["alone"] is False
    assert len(tiny.prompt_data["samples"]) == 160


def test_a_clip_whose_peak_a_batch_moves_keeps_its_batched_features_once() -> None:
    """A click in a clip's last samples is its loudest moment, which the batch's zeros remove:
    every frame's clamp moves. The item keeps the batched clip once (float32 bytes), and a
    request beside a longer clip still equals vLLM's batched call."""
    rng = np.random.default_rng(SEED)
    proc = hf_processor(NAME)
    ours = build_processor(NAME, proc)
    # near silence (every frame clamped) and a click in the last 60 samples, its peak
    click = (1e-5 * rng.standard_normal(RATE * 2)).astype(np.float32)
    click[-60:] = 0.5
    (item,) = ours.process_items({"audio": [click]}, {})["audio"]
    padded = item.prompt_data["padded"]
    assert set(padded["1"]) == {"all", "shape"} and padded["1"]["shape"] == [128, 200]
    assert padded["2"] == {"same_as": "1"}
    clips = [click, _clip(rng, RATE * 3)]
    text = f"user {AUDIO} {AUDIO} assistant"
    ref = _vllm_reference(proc, text, clips)
    out = ours.apply(proc.tokenizer(text)["input_ids"], {"audio": clips})
    _assert_audio_equal(out.merged_kwargs(), ref, f"click seed={SEED}")


def test_refusals() -> None:
    ours = build_processor(NAME)
    with pytest.raises(ProcessorKwargsError, match="use_audio_in_video"):
        ours.process_items(
            {"audio": [np.full(RATE, 0.1, np.float32)]}, {"use_audio_in_video": True}
        )
    ids = ours.hf_processor.tokenizer(f"user {AUDIO} assistant")["input_ids"]
    with pytest.raises(ItemRejectedError, match="a clip of 160 samples"):
        ours.apply(ids, {"audio": [np.full(100, 0.1, np.float32)]})
    with pytest.raises(ItemRejectedError, match="clip 0 has no samples"):
        ours.apply(ids, {"audio": [np.zeros(0, np.float32)]})


def test_the_folder_names_the_tokenizers_ids(tmp_path: Any) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from aiomm.adapters.folders import write_model_folder

    folder = write_model_folder(NAME, tmp_path / "omni")
    tok = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    thinker = config["thinker_config"]
    for key, token in (("audio_token_id", AUDIO_TOKEN), ("image_token_id", IMAGE_TOKEN),
                       ("video_token_id", VIDEO_TOKEN), ("audio_start_token_id", AUDIO_START),
                       ("audio_end_token_id", AUDIO_END)):  # fmt: skip
        assert thinker[key] == tok.convert_tokens_to_ids(token), key
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    loaded = AutoConfig.from_pretrained(str(folder)).thinker_config
    assert loaded.vision_config.patch_size == 16 and loaded.audio_config.n_window == 50
    content = [
        {"type": "image"},
        {"type": "audio"},
        {"type": "video"},
        {"type": "text", "text": "x"},
    ]
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert f"{IMAGE}{AUDIO}{VIDEO}x<|im_end|>" in text
