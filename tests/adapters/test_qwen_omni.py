"""Qwen2.5-Omni cases beyond the parity harness (which covers its images on both backends):
audio against the HF processor as vLLM calls it and post-processes it, images, videos and audio
in one request, the token count rules, the items' fields, the folder, and the errors."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from parity import SEED, hf_processor
from video_samples import noise_clip

from aiomm.adapters import build_processor
from aiomm.adapters.qwen2_audio import audio_output_length
from aiomm.adapters.qwen_omni import (
    AUDIO_BOS,
    AUDIO_EOS,
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    QWEN_OMNI_FEATURE_PARAMS,
    VIDEO_TOKEN,
    VISION_BOS,
    VISION_EOS,
    FeatureFramesField,
)
from aiomm.errors import (
    ItemCountMismatchError,
    ItemRejectedError,
    ProcessingError,
    ProcessorKwargsError,
)
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig

NAME = "qwen2.5-omni"
RATE = 16000
AUDIO = AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS
IMAGE = VISION_BOS + IMAGE_TOKEN + VISION_EOS
VIDEO = VISION_BOS + VIDEO_TOKEN + VISION_EOS


def _vllm_reference(proc: Any, text: str, **data: Any) -> dict[str, Any]:
    """The HF processor as vLLM's processor calls it (its text with ``truncation=False``), then
    vLLM's ``_postprocess_hf_mm_data``: each clip's own frames flat along dim 1, their counts."""
    out = dict(proc(text=[text], **data, truncation=False, return_tensors="pt"))
    mask = out.get("feature_attention_mask")
    if mask is not None:
        features = out.pop("input_features")
        out["input_audio_features"] = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        out["audio_feature_lengths"] = mask.sum(-1)
    if "video_second_per_grid" in out:
        out["second_per_grid_ts"] = out.pop("video_second_per_grid")
    return out


def test_the_token_count_is_the_processors_for_every_feature_length() -> None:
    """Every mask length a 300 s chunk (and a little more) can have: the HF processor's rule,
    which vLLM's ``_get_feat_extract_output_lengths`` restates."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths,
    )

    lengths = torch.arange(0, 30101)
    want = _get_feat_extract_output_lengths(lengths)
    # the rule is integer arithmetic: applied to the tensor at once
    assert torch.equal(audio_output_length(lengths), want)  # type: ignore[arg-type]
    assert [audio_output_length(int(n)) for n in lengths[::997]] == want[::997].tolist()
    assert audio_output_length(30000) == 7500


def test_the_reference_has_the_checkpoints_feature_extractor() -> None:
    extractor = hf_processor(NAME).feature_extractor
    for key, value in QWEN_OMNI_FEATURE_PARAMS.items():
        if key != "return_attention_mask":
            assert getattr(extractor, key) == value, key
    assert extractor.n_samples == 300 * RATE  # 300 s chunks, not Qwen2-Audio's 30 s


@pytest.mark.parametrize(
    "samples",
    [
        321,  # three frames: the shortest clip with an audio token
        16000,
        RATE * 30 + 7,  # past Qwen2-Audio's 30 s chunk: nothing is cut
        RATE * 300,  # exactly one chunk
        RATE * 300 + 161,  # longer than the chunk: kept whole (truncation=False)
    ],
)
def test_native_and_hf_audio_equal_the_reference(samples: int) -> None:
    rng = np.random.default_rng(SEED + samples)
    proc = hf_processor(NAME)
    clips = [
        (0.3 * rng.standard_normal(samples)).astype(np.float32),
        np.clip(3 * rng.standard_normal(samples), -1.0, 1.0).astype(np.float32),  # clipping
    ]
    text = f"user {AUDIO} and {AUDIO} assistant"
    ref = _vllm_reference(proc, text, audio=clips)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    # frames whose hop starts inside the clip, of the padded (or whole) clip's frames
    frames = min(-(-samples // 160), max(samples, RATE * 300) // 160)
    for mode in ("hf", "native"):
        ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"audio": clips})
        where = f"{mode} {samples} samples seed={SEED}"
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), where
        merged = out.merged_kwargs()
        for key in ("input_audio_features", "audio_feature_lengths", "feature_attention_mask"):
            assert merged[key].dtype == ref[key].dtype, f"{where}: {key}"
            assert torch.equal(merged[key], ref[key]), f"{where}: {key}"
        assert merged["input_audio_features"].shape == (128, 2 * frames), where
        assert [r.length for r in out.mm_placeholders["audio"]] == [
            audio_output_length(frames)
        ] * 2, where


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_images_videos_and_audio_in_one_request_equal_the_reference(backend: str) -> None:
    rng = np.random.default_rng(SEED)
    proc = hf_processor(NAME, backend)
    images = [photo_like(rng, 100, 150), photo_like(rng, 333, 500)]
    clips = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in (RATE * 3, 5000)]
    video = noise_clip(rng, 4, 90, 160)
    text = f"user {IMAGE} hear {AUDIO} {VIDEO} then {AUDIO} and {IMAGE} assistant"
    ref = _vllm_reference(
        proc, text, images=images, audio=clips, videos=[video.frames],
        videos_kwargs={"do_sample_frames": False, "cap_pixels_per_frame": False},
    )  # fmt: skip
    ref_ids = ref["input_ids"][0].tolist()
    prompt_ids = proc.tokenizer(text)["input_ids"]
    tokens = {m: proc.tokenizer.convert_tokens_to_ids(t) for m, t in
              (("image", IMAGE_TOKEN), ("audio", AUDIO_TOKEN), ("video", VIDEO_TOKEN))}  # fmt: skip
    for mode in ("hf", "native"):
        ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"image": images, "audio": clips, "video": [video]})
        where = f"{backend} {mode} seed={SEED}"
        assert out.prompt_token_ids == ref_ids, where
        for modality, token in tokens.items():
            ranges = out.mm_placeholders[modality]
            covered = [r.offset + j for r in ranges for j in range(r.length)]
            assert covered == [i for i, t in enumerate(ref_ids) if t == token], where
            assert all(r.is_embed is None for r in ranges), where
        merged = out.merged_kwargs()
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                    "second_per_grid_ts", "input_audio_features", "audio_feature_lengths",
                    "feature_attention_mask"):  # fmt: skip
            assert merged[key].dtype == ref[key].dtype, f"{where}: {key}"
            assert torch.equal(merged[key], ref[key]), f"{where}: {key}"
        assert merged["use_audio_in_video"].item() is False
        assert out.normalization is None  # vLLM's Qwen2.5-Omni takes normalised pixels


def test_videos_take_the_omni_processors_pixel_bounds_and_seconds() -> None:
    """A video frame resizes within 128 to 768 merged patches (the processor's own video
    ``size``, not the video processor's), and ``second_per_grid_ts`` is 2 / fps."""
    ours = build_processor(NAME)
    rng = np.random.default_rng(SEED)
    small, large = noise_clip(rng, 2, 28, 28), noise_clip(rng, 2, 1080, 1920)
    items = ours.process_items({"video": [small, large]}, {})["video"]
    grids = [item.data["video_grid_thw"].tolist() for item in items]
    merged_patches = [h * w // 4 for _, h, w in grids]
    assert merged_patches[0] >= 128 and merged_patches[1] <= 768, grids
    assert [float(item.data["second_per_grid_ts"]) for item in items] == [1.0, 1.0]
    items = ours.process_items({"video": [small]}, {"fps": 4.0})["video"]
    assert float(items[0].data["second_per_grid_ts"]) == 0.5


def test_audio_items_hold_their_own_frames() -> None:
    ours = build_processor(NAME)
    clips = [np.full(8000, 0.1, np.float32), np.full(RATE * 2, 0.1, np.float32)]
    items = ours.process_items({"audio": clips}, {})["audio"]
    assert [tuple(i.data["input_audio_features"].shape) for i in items] == [(128, 50), (128, 200)]
    assert [int(i.data["audio_feature_lengths"]) for i in items] == [50, 200]
    assert [tuple(i.data["feature_attention_mask"].shape) for i in items] == [(30000,)] * 2
    field = items[0].fields["input_audio_features"]
    assert isinstance(field, FeatureFramesField) and field.dim == 1
    assert {k: type(c).__name__ for k, c in items[0].fields.items()} == {
        "input_audio_features": "FeatureFramesField",
        "feature_attention_mask": "MultiModalFieldConfig",
        "audio_feature_lengths": "MultiModalFieldConfig",
    }


def test_feature_frames_split_and_merge_along_dim_1() -> None:
    batch = torch.arange(3 * 7, dtype=torch.float32).reshape(3, 7)
    field = FeatureFramesField("audio", (2, 5))
    parts = field.split("x", batch)
    assert [tuple(p.shape) for p in parts] == [(3, 2), (3, 5)]
    assert torch.equal(field.merge(parts[::-1]), torch.cat([batch[:, 2:], batch[:, :2]], 1))
    assert parts[0].untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    with pytest.raises(ProcessingError, match="7 frames but its item sizes"):
        FeatureFramesField("audio", (2, 4)).split("x", batch)


def test_refusals() -> None:
    ours = build_processor(NAME)
    with pytest.raises(ItemRejectedError, match="too short to be represented"):
        ours.process_items({"audio": [np.full(161, 0.1, np.float32)]}, {})
    with pytest.raises(ProcessorKwargsError, match="use_audio_in_video"):
        ours.process_items(
            {"audio": [np.full(RATE, 0.1, np.float32)]}, {"use_audio_in_video": True}
        )
    with pytest.raises(ProcessorKwargsError):
        ours.process_items({"audio": [np.full(RATE, 0.1, np.float32)]}, {"sampling_rate": 8000})
    ids = ours.hf_processor.tokenizer(f"user {AUDIO} assistant")["input_ids"]
    clip = np.full(RATE, 0.1, np.float32)
    with pytest.raises(ItemCountMismatchError):
        ours.apply(ids, {"audio": [clip, clip]})


def test_the_folder_names_the_tokenizers_ids(tmp_path: Any) -> None:
    from transformers import AutoTokenizer

    from aiomm.adapters.folders import write_model_folder

    folder = write_model_folder(NAME, tmp_path / "omni")
    tok = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    thinker = config["thinker_config"]
    for key, token in (("audio_token_index", AUDIO_TOKEN), ("image_token_index", IMAGE_TOKEN),
                       ("video_token_index", VIDEO_TOKEN), ("audio_start_token_id", AUDIO_BOS),
                       ("audio_end_token_id", AUDIO_EOS)):  # fmt: skip
        assert thinker[key] == tok.convert_tokens_to_ids(token), key
    assert "Qwen2_5OmniModel" in config["architectures"]  # the name vLLM registers
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
