"""Audio requests through the Engine: equal to ``processor.apply`` on vLLM's decoded waveform,
identified by blake3 of the encoded bytes (hashed before any decode) or by vLLM's mm_hash of the
resampled waveform (``VllmHasher``, replayed from ``fixtures_audio_hashes.json``), cached in a
namespace of their own with single flight, and a bad clip a typed error of its own request only."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from audio_samples import CASES, AudioCase, encode, signal

from aiomm.adapters import build_processor
from aiomm.adapters.qwen2_audio import AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN
from aiomm.cache.item_cache import CacheOutcome
from aiomm.config import DecodeConfig, EngineConfig
from aiomm.engine import Engine
from aiomm.errors import (
    AudioDecodeError,
    AudioTooLargeError,
    AudioTooLongError,
    ConfigError,
    InvalidRequestError,
    InvalidSourceError,
    ItemRejectedError,
    UnknownModalityError,
)
from aiomm.media.audio import decode_audio
from aiomm.media.hashing import hash_bytes
from aiomm.types import Request
from aiomm.vllm.media import VllmDecoder, VllmHasher
from aiomm.vllm.mm_hash import audio_mm_hash

sys.path.insert(0, str(Path(__file__).parent))
from record_audio_hashes import arrays

NAME = "qwen2-audio"
PLACEHOLDER = AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS
FIXTURES = json.loads((Path(__file__).with_name("fixtures_audio_hashes.json")).read_text())
CLIPS = {case.name: case for case in CASES}
WAV, FLAC, MP3 = (encode(CLIPS[n]) for n in ("wav_8k_mono_pcm16", "flac_44100_stereo",
                                             "mp3_22050_mono"))  # fmt: skip


def _engine(*, hasher: Any = None, cache: bool = True, **decode: Any) -> Engine:
    config = EngineConfig(
        device="cpu",
        transform_threads=2,
        cache_capacity_bytes=(64 << 20) if cache else 0,
        decode=DecodeConfig(**decode),
    )
    return Engine(build_processor(NAME), config, hasher=hasher)


def _vllm_hasher() -> VllmHasher:
    return VllmHasher(FIXTURES["model_id"], VllmDecoder(), max_video_bytes=1 << 26)


def _prompt(n: int) -> str:
    return "user describe " + " and ".join([PLACEHOLDER] * n) + " assistant"


def _expected(engine: Engine, prompt: str, clips: list[bytes]) -> Any:
    proc = engine.processor
    ids = proc.hf_processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    waves = [decode_audio(c, target_rate=16000) for c in clips]
    return proc.apply(ids, {"audio": waves})


def _assert_equal(result: Any, out: Any) -> None:
    assert result.ok, result.error
    assert result.prompt_token_ids == out.prompt_token_ids
    assert result.mm_placeholders == out.mm_placeholders
    merged = out.merged_kwargs()
    assert set(result.mm_kwargs) == set(merged)
    for key, value in merged.items():
        assert torch.equal(result.mm_kwargs[key], value), key


@pytest.mark.parametrize("name", sorted(FIXTURES["arrays"]))
def test_audio_mm_hash_equals_vllms_hasher(name: str) -> None:
    assert audio_mm_hash(arrays()[name], FIXTURES["model_id"]) == FIXTURES["arrays"][name]


async def test_vllm_hasher_gives_vllms_mm_hash_of_encoded_clips() -> None:
    names = sorted(FIXTURES["clips"])
    clips = [encode(CLIPS[n]) for n in names]
    async with _engine(hasher=_vllm_hasher()) as engine:
        result = await engine.process(Request(prompt=_prompt(len(clips)), audios=clips))
        _assert_equal(result, _expected(engine, _prompt(len(clips)), clips))
        assert result.item_ids == [FIXTURES["clips"][n]["mm_hash"] for n in names]
        frames = result.mm_kwargs["feature_attention_mask"].sum(-1).tolist()
        assert frames == [-(-FIXTURES["clips"][n]["len"] // 160) for n in names]
    # the hasher alone (a caller without the engine) decodes the bytes itself
    assert _vllm_hasher().hash_audio(clips[0]) == FIXTURES["clips"][names[0]]["mm_hash"]


async def test_encoded_bytes_are_identified_before_decoding(monkeypatch) -> None:
    import aiomm.engine._audio as audio_module

    decodes = []
    real = audio_module.decode_audio

    def counted(data: bytes, **kwargs: Any) -> np.ndarray:
        decodes.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(audio_module, "decode_audio", counted)
    async with _engine() as engine:
        request = Request(prompt=_prompt(3), audios=[WAV, FLAC, MP3])
        first = await engine.process(request)
        _assert_equal(first, _expected(engine, _prompt(3), [WAV, FLAC, MP3]))
        assert first.item_ids == [hash_bytes(c) for c in (WAV, FLAC, MP3)]
        assert len(decodes) == 3
        again = await engine.process(Request(prompt=_prompt(2), audios=[MP3, WAV]))
        assert again.cache == [CacheOutcome.HIT] * 2 and len(decodes) == 3  # no decode
        assert engine.stats().audios_processed == 5
    async with _engine(hasher=_vllm_hasher()) as engine:
        decodes.clear()
        for _ in range(2):
            result = await engine.process(Request(prompt=_prompt(1), audios=[FLAC]))
        # vLLM's mm_hash is over the waveform: decoded once a request, never again for the
        # transform (a hit still decodes to know its id)
        assert result.cache == [CacheOutcome.HIT] and len(decodes) == 2


async def test_concurrent_requests_for_one_clip_compute_it_once() -> None:
    async with _engine() as engine:
        results: list[Any] = [None] * 4

        async def one(i: int) -> None:
            results[i] = await engine.process(Request(prompt=_prompt(1), audios=[MP3]))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        outcomes = [r.cache[0] for r in results]
        assert outcomes.count(CacheOutcome.MISS) == 1, outcomes
        assert set(outcomes) <= {CacheOutcome.MISS, CacheOutcome.JOINED, CacheOutcome.HIT}
        for r in results[1:]:
            assert torch.equal(
                r.mm_kwargs["input_features"], results[0].mm_kwargs["input_features"]
            )


async def test_samples_in_memory_equal_their_encoded_clip() -> None:
    """A ``(samples, rate)`` tuple (channels x time) is averaged and resampled as decoded
    audio is; its id is blake3 of the resampled waveform (vLLM's mm_hash with VllmHasher)."""
    case = AudioCase("stereo", "WAV", "FLOAT", 22050, 2, seconds=1.3)
    samples = signal(case.rate, case.channels, case.seconds)
    data = encode(case, samples)
    waveform = decode_audio(data, target_rate=16000)
    async with _engine(hasher=_vllm_hasher()) as engine:
        from_bytes = await engine.process(Request(prompt=_prompt(1), audios=[data]))
        in_memory = await engine.process(
            Request(prompt=_prompt(1), audios=[(samples.T, case.rate)])
        )
        assert in_memory.cache == [CacheOutcome.HIT]  # the same waveform, the same id
        assert in_memory.item_ids == from_bytes.item_ids
        assert from_bytes.item_ids == [audio_mm_hash(waveform, FIXTURES["model_id"])]
        _assert_equal(in_memory, _expected(engine, _prompt(1), [data]))
    async with _engine() as engine:
        mono = await engine.process(Request(prompt=_prompt(1), audios=[(samples[:, 0], 22050)]))
        assert mono.ok and mono.item_ids[0] != hash_bytes(data)


async def test_supplied_ids_key_the_cache_and_are_reported() -> None:
    async with _engine() as engine:
        first = await engine.process(
            Request(prompt=_prompt(2), audios=[WAV, FLAC], audio_hashes=["clip-a", None])
        )
        assert first.item_ids == ["clip-a", hash_bytes(FLAC)]
        # a hit on the supplied id skips even the load: a source that cannot be read is fine
        again = await engine.process(
            Request(prompt=_prompt(1), audios=["/nowhere/missing.wav"], audio_hashes=["clip-a"])
        )
        assert again.cache == [CacheOutcome.HIT] and again.item_ids == ["clip-a"]


async def test_a_bad_clip_fails_its_request_naming_the_item_and_others_go_on() -> None:
    requests = [
        Request(prompt=_prompt(1), audios=[WAV], request_id="good-1"),
        Request(prompt=_prompt(2), audios=[FLAC, b"RIFF not really audio"], request_id="bad"),
        Request(prompt=_prompt(1), audios=[np.zeros(3)], request_id="not-a-tuple"),
        Request(prompt=_prompt(1), audios=[(np.zeros(100, np.float32), 16000)], request_id="short"),
        Request(prompt=_prompt(1), audios=[MP3], request_id="good-2"),
    ]
    async with _engine() as engine:
        async with engine.stream(requests) as stream:
            results = {r.request_id: r async for r in stream}
    assert results["good-1"].ok and results["good-2"].ok
    bad = results["bad"].error
    assert isinstance(bad, AudioDecodeError) and bad.item_index == 1
    assert isinstance(results["not-a-tuple"].error, InvalidSourceError)
    short = results["short"].error
    assert isinstance(short, ItemRejectedError) and short.item_index == 0
    assert "too short to be represented" in str(short)


async def test_the_audio_limits_of_the_decode_config() -> None:
    long_clip = encode(AudioCase("long", "WAV", "PCM_16", 16000, 1, seconds=2.0))
    async with _engine(max_audio_duration_s=1.5, max_audio_bytes=200_000) as engine:
        for source in (long_clip, (np.zeros(40_000, np.float32), 16000)):
            with pytest.raises(AudioTooLongError):
                await engine.process(Request(prompt=_prompt(1), audios=[source]))
        big = encode(AudioCase("big", "WAV", "FLOAT", 48000, 2, seconds=0.6))
        with pytest.raises(AudioTooLargeError):
            await engine.process(Request(prompt=_prompt(1), audios=[big]))
    for bad in (
        {"max_audio_duration_s": 0},
        {"max_audio_bytes": 0},
        {"max_audio_decode_bytes": -1},
    ):
        with pytest.raises(ConfigError):
            DecodeConfig(**bad)


async def test_modalities_an_adapter_does_not_take_are_refused() -> None:
    async with _engine() as engine:
        with pytest.raises(UnknownModalityError, match="'image'"):
            await engine.process(Request(prompt=_prompt(1), images=[WAV]))
    config = EngineConfig(device="cpu", transform_threads=1)
    async with Engine(build_processor("qwen2-vl"), config) as engine:
        with pytest.raises(UnknownModalityError, match="'audio'"):
            await engine.process(Request(prompt="describe", audios=[WAV]))


def test_requests_check_their_audio_fields() -> None:
    with pytest.raises(InvalidRequestError, match="audios must be a sequence"):
        Request(prompt="x", audios=WAV)
    with pytest.raises(InvalidRequestError, match="audio_hashes has 1 entries for 2 audios"):
        Request(prompt="x", audios=[WAV, FLAC], audio_hashes=["a"])


async def test_audio_keys_never_share_an_entry_with_an_image_of_the_same_id() -> None:
    async with _engine() as engine:
        pipeline = engine._pipeline
        assert pipeline is not None
        keys = {kind: pipeline._key(kind, "same-id", {}) for kind in ("image", "video", "audio")}
        assert len(set(keys.values())) == 3
