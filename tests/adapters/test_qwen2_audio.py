"""Qwen2-Audio cases beyond the parity harness: the token count rule for every feature length,
clips at the edges (silence, clipping, the 30 s chunk), prompt expansion, the folder's template
and config, and the errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from parity import SEED, hf_processor

from aiomm.adapters import build_processor
from aiomm.adapters.qwen2_audio import (
    AUDIO_BOS,
    AUDIO_EOS,
    AUDIO_TOKEN,
    QWEN2_AUDIO_FEATURE_PARAMS,
    audio_output_length,
)
from aiomm.errors import (
    ItemCountMismatchError,
    ItemRejectedError,
    ProcessorKwargsError,
    UnknownModalityError,
)
from aiomm.processing.processor import MultiModalConfig

NAME = "qwen2-audio"
PLACEHOLDER = AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS
RATE = 16000


def _hf(proc: Any, text: str, clips: list[np.ndarray]) -> Any:
    """The reference as vLLM calls it."""
    return proc(text=[text], audio=clips, sampling_rate=RATE, truncation=True, return_tensors="pt")


def _prompt(n: int) -> str:
    return "user describe " + " and ".join([PLACEHOLDER] * n) + " assistant"


def test_the_token_count_is_the_encoders_for_every_feature_length() -> None:
    """vLLM's ``_get_feat_extract_output_lengths`` is the HF encoder's: checked for every mask
    length a 30 s chunk can have."""
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    lengths = torch.arange(0, 3001)
    _, want = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, lengths)  # type: ignore[arg-type]
    assert [audio_output_length(int(n)) for n in lengths] == want.tolist()
    assert audio_output_length(3000) == 750 and audio_output_length(2) == 0


def test_the_reference_has_the_checkpoints_feature_extractor() -> None:
    extractor = hf_processor(NAME).feature_extractor
    for key, value in QWEN2_AUDIO_FEATURE_PARAMS.items():
        if key != "return_attention_mask":
            assert getattr(extractor, key) == value, key
    assert extractor.mel_filters.shape == (201, 128)


@pytest.mark.parametrize(
    "samples",
    [
        321,  # three frames: the shortest clip with an audio token
        480,
        16000,
        RATE * 30 - 1,
        RATE * 30,  # exactly one chunk
        RATE * 30 + 1,  # cut to one chunk
        RATE * 47,
    ],
)
def test_native_and_hf_equal_the_reference_at_the_edges(samples: int) -> None:
    rng = np.random.default_rng(SEED + samples)
    proc = hf_processor(NAME)
    clips = [
        (0.3 * rng.standard_normal(samples)).astype(np.float32),
        np.zeros(samples, np.float32),  # silence: every value the padding constant's
        np.clip(3 * rng.standard_normal(samples), -1.0, 1.0).astype(np.float32),  # clipping
    ]
    text = _prompt(len(clips))
    ref = _hf(proc, text, clips)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    for mode in ("hf", "native"):
        ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"audio": clips})
        where = f"{mode} {samples} samples seed={SEED}"
        assert out.prompt_token_ids == ref["input_ids"][0].tolist(), where
        merged = out.merged_kwargs()
        for key in ("input_features", "feature_attention_mask"):
            assert torch.equal(merged[key], ref[key]), f"{where}: {key}"
        frames = min(-(-samples // 160), 3000)
        assert [r.length for r in out.mm_placeholders["audio"]] == [
            audio_output_length(frames)
        ] * 3, where


def test_items_are_batched_rows_of_one_chunk() -> None:
    ours = build_processor(NAME)
    clips = [np.ones(8000, np.float32) * 0.1, np.ones(RATE * 31, np.float32) * 0.1]
    items = ours.process_items({"audio": clips}, {})["audio"]
    assert [tuple(i.data["input_features"].shape) for i in items] == [(128, 3000)] * 2
    assert [int(i.data["feature_attention_mask"].sum()) for i in items] == [50, 3000]
    assert items[0].data["feature_attention_mask"].dtype == torch.int32
    assert {key: cfg.kind.name for key, cfg in items[0].fields.items()} == {
        "input_features": "BATCHED",
        "feature_attention_mask": "BATCHED",
    }
    assert ours.device_normalize is False and ours.audio_sampling_rate == RATE


def test_placeholders_follow_the_prompt_order_between_text() -> None:
    ours = build_processor(NAME)
    tok = ours.hf_processor.tokenizer
    clips = [np.full(n, 0.2, np.float32) for n in (RATE, 3200, RATE * 2)]
    text = f"first {PLACEHOLDER} second {PLACEHOLDER} third {PLACEHOLDER} please"
    out = ours.apply(tok(text)["input_ids"], {"audio": clips})
    ranges = out.mm_placeholders["audio"]
    assert [r.length for r in ranges] == [25, 5, 50]
    ids = out.prompt_token_ids
    audio = ours.audio_token_id
    for r in ranges:
        assert ids[r.offset - 1] == tok.convert_tokens_to_ids(AUDIO_BOS)
        assert ids[r.offset : r.offset + r.length] == [audio] * r.length
        assert ids[r.offset + r.length] == tok.convert_tokens_to_ids(AUDIO_EOS)
        assert r.is_embed is None


def test_a_clip_too_short_for_a_token_is_refused_as_vllm_refuses_it() -> None:
    ours = build_processor(NAME)
    for samples in (1, 160, 161):  # one or two feature frames: no audio token
        with pytest.raises(ItemRejectedError, match="too short to be represented") as info:
            ours.process_items({"audio": [np.full(samples, 0.1, np.float32)]}, {})
        assert info.value.modality == "audio"
    ours.process_items({"audio": [np.full(321, 0.1, np.float32)]}, {})  # three frames: one


def test_errors() -> None:
    ours = build_processor(NAME)
    ids = ours.hf_processor.tokenizer(_prompt(1))["input_ids"]
    clip = np.zeros(RATE, np.float32)
    with pytest.raises(ItemCountMismatchError):
        ours.apply(ids, {"audio": [clip, clip]})
    with pytest.raises(UnknownModalityError, match=r"'image'.*\['audio'\]"):
        ours.apply(ids, {"image": [np.zeros((8, 8, 3), np.uint8)]})
    with pytest.raises(ProcessorKwargsError):
        ours.apply(ids, {"audio": [clip]}, {"sampling_rate": 8000})
    with pytest.raises(ValueError, match="normalised on the device"):
        build_processor(NAME, config=MultiModalConfig(mm_device_do_normalize=True))


def test_the_folders_template_writes_the_checkpoints_audio_placeholder(tmp_path: Any) -> None:
    import json

    from transformers import AutoTokenizer

    from aiomm.adapters.folders import write_model_folder

    folder = write_model_folder(NAME, tmp_path / NAME)
    tok = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    assert config["audio_token_index"] == tok.convert_tokens_to_ids(AUDIO_TOKEN)
    assert config["audio_config"]["num_mel_bins"] == 128
    content = [{"type": "audio"}, {"type": "text", "text": "what is this"}, {"type": "audio"}]
    conversation = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    # the published template (transformers keeps it as the processor's default)
    published = hf_processor(NAME).default_chat_template
    assert text == tok.apply_chat_template(
        conversation, chat_template=published, tokenize=False, add_generation_prompt=True
    )
    assert text.count(f"Audio 2: {PLACEHOLDER}\n") == 1
