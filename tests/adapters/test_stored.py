"""adapters/_stored.py: the shipped snapshots equal fresh ones, the store covers every
architecture, and a processor built from a snapshot behaves as the one built over the real HF
processor, which it builds only on demand."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aiomm.adapters import build_processor, get_adapter_info, supported_adapters
from aiomm.adapters._store_update import BACKENDS, builders, stored_names
from aiomm.adapters._stored import (
    STORE,
    StoredHFProcessor,
    _versions,
    build_store,
    hf_class_name,
    offline_hf_processor,
)
from aiomm.media.samples import photo_like
from aiomm.processing.image_ops import Backend
from aiomm.processing.processor import MultiModalConfig

PROMPTS = (
    "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|> describe  the\n image<|im_end|>",
    "unknown words, punctuation!  <|vision_start|><|video_pad|><|vision_end|>",
    "",
    "   ",
    "<|endoftext|><|im_start|>assistant",
)


SHIPPED = json.loads(STORE.read_text())
#: every architecture is stored
NAMES = [i.short_name for i in supported_adapters()]
#: the architectures that take images (both image backends); the others take audio (one)
IMAGE_NAMES = {
    i.short_name
    for i in supported_adapters()
    if "image" in i.processor_cls.dummy_inputs.placeholders
}


def test_the_store_covers_every_architecture_and_these_versions() -> None:
    """Regenerate with ``python -P -m aiomm.adapters._store_update`` when this fails."""
    assert list(stored_names()) == NAMES
    assert {"qwen2-vl", "gemma3", "deepseek-ocr", "llama-nemotron-vl-embed"} <= set(NAMES)
    keys = {f"{name}/{backend}" for name in stored_names() for backend in BACKENDS}
    assert set(SHIPPED["processors"]) == keys
    assert SHIPPED["versions"] == _versions()
    used = {spec["tokenizer"] for spec in SHIPPED["processors"].values()}
    assert used == set(SHIPPED["tokenizers"])  # each stored once, none left over


@pytest.mark.parametrize("name", NAMES)
def test_the_shipped_snapshots_equal_fresh_ones(name: str) -> None:
    """Regenerate with ``python -P -m aiomm.adapters._store_update`` when this fails."""
    fresh = json.loads(
        json.dumps(build_store(b for b in builders() if b[0].startswith(f"{name}/")))
    )
    for key, spec in fresh["processors"].items():
        shipped = SHIPPED["processors"][key]
        assert {**shipped, "tokenizer": None} == {**spec, "tokenizer": None}, key
        tokenizer = SHIPPED["tokenizers"][shipped["tokenizer"]]
        assert tokenizer == fresh["tokenizers"][spec["tokenizer"]], key


def _items(name: str) -> tuple[str, dict[str, list[Any]]]:
    """A prompt with two of the architecture's placeholders and its two items: images, or
    for an audio-only one, clips (a second and a half of noise, a tone)."""
    placeholders = get_adapter_info(name).processor_cls.dummy_inputs.placeholders
    modality = "image" if "image" in placeholders else "audio"
    text = f"look {placeholders[modality]} and {placeholders[modality]} here"
    nrng = np.random.default_rng(11)
    if modality == "image":
        return text, {"image": [photo_like(nrng, 50, 70), photo_like(nrng, 130, 40)]}
    tone = np.sin(np.arange(8000, dtype=np.float32) * 0.05).astype(np.float32)
    return text, {"audio": [nrng.standard_normal(24000).astype(np.float32) * 0.1, tone]}


@pytest.mark.parametrize(
    ("name", "backend"),
    [(n, b) for n in NAMES for b in (BACKENDS if n in IMAGE_NAMES else BACKENDS[:1])],
)
def test_the_native_path_of_a_snapshot_equals_the_real_processors(name: str, backend: str) -> None:
    """Built by name, an architecture's processor serves the snapshot: its token ids, ranges,
    items and routing plans equal those of the processor over the real HF processor, which
    the native path never builds (with pixels normalised on the device; on the CPU too where
    the snapshot restates the operation: the torchvision backend's own)."""
    real_hf = get_adapter_info(name).build_hf_processor(backend=backend)
    text, items = _items(name)
    configs = [MultiModalConfig(mm_device_do_normalize=True)] if "image" in items else []
    if backend == "torchvision":
        configs.append(MultiModalConfig())  # the architecture's default
    for config in configs:
        stored = build_processor(name, backend=backend, config=config)
        snapshot_hf = stored.hf_processor
        assert isinstance(snapshot_hf, StoredHFProcessor)
        real = build_processor(name, real_hf, config=config)
        assert stored.allowed_hf_kwargs() == real.allowed_hf_kwargs()
        tokens = snapshot_hf.tokenizer(text, add_special_tokens=False)
        assert tokens == dict(real_hf.tokenizer(text, add_special_tokens=False))
        ids = tokens["input_ids"]
        ours, theirs = stored.apply(ids, items), real.apply(ids, items)
        assert ours.prompt_token_ids == theirs.prompt_token_ids, config
        assert ours.mm_placeholders == theirs.mm_placeholders, config
        merged = ours.merged_kwargs()
        for key, value in theirs.merged_kwargs().items():
            assert torch.equal(merged[key], value), (config, key)
        assert ours.normalization == theirs.normalization
        for height, width in ((50, 70), (2000, 900)) if "image" in items else ():
            plan, full = stored.plan_image(height, width, {}), real.plan_image(height, width, {})
            assert plan.prompt_data == full.prompt_data
            assert plan.data.keys() == full.data.keys()
            assert all(torch.equal(plan.data[k], full.data[k]) for k in full.data)
        image_processor = getattr(snapshot_hf, "image_processor", None)
        restated = getattr(image_processor, "torchvision_operations", True)
        if stored.device_normalize or restated:
            assert not snapshot_hf.built, config
    # what the adapters read of the tokenizer: special tokens, their ids, the vocabulary
    stored_tokenizer, real_tokenizer = snapshot_hf.tokenizer, real_hf.tokenizer
    for attribute in ("bos_token", "eos_token", "pad_token", "all_special_ids"):
        assert getattr(stored_tokenizer, attribute) == getattr(real_tokenizer, attribute)
    assert stored_tokenizer.get_vocab() == real_tokenizer.get_vocab()
    specials = list(real_tokenizer.all_special_tokens)
    assert stored_tokenizer.convert_tokens_to_ids(specials) == (
        real_tokenizer.convert_tokens_to_ids(specials)
    )


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_build_processor_uses_the_snapshot_and_matches_the_real_processor(backend: str) -> None:
    stored = build_processor("qwen2-vl", backend=backend)
    assert isinstance(stored.hf_processor, StoredHFProcessor)
    real_hf = get_adapter_info("qwen2-vl").build_hf_processor(backend=backend)
    real = build_processor("qwen2-vl", real_hf)
    assert stored.backend is real.backend is Backend(backend)
    assert stored.allowed_hf_kwargs() == real.allowed_hf_kwargs()
    assert stored._resolve_params({}) == real._resolve_params({})
    assert stored._resolve_video_params({}) == real._resolve_video_params({})
    assert stored.supports_video and stored._seconds_per_grid == real._seconds_per_grid
    assert hf_class_name(stored.hf_processor) == type(real_hf).__name__
    for part in ("image_processor", "video_processor"):
        ours_part = getattr(stored.hf_processor, part)
        assert hf_class_name(ours_part) == type(getattr(real_hf, part)).__name__, part
    for text in PROMPTS:
        for special in (True, False):
            ours = stored.hf_processor.tokenizer(text, add_special_tokens=special)
            assert ours == dict(real_hf.tokenizer(text, add_special_tokens=special)), text
            encoded = stored.hf_processor.tokenizer.encode(text, add_special_tokens=special)
            assert encoded == real_hf.tokenizer.encode(text, add_special_tokens=special), text
    image = photo_like(np.random.default_rng(7), 123, 301)
    ids = stored.hf_processor.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    ours, theirs = stored.apply(ids, {"image": [image]}), real.apply(ids, {"image": [image]})
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    assert ours.mm_placeholders == theirs.mm_placeholders
    for key, value in theirs.merged_kwargs().items():
        assert torch.equal(ours.merged_kwargs()[key], value), key
    assert ours.normalization == theirs.normalization
    # the native path never needed the real processor
    assert not stored.hf_processor.built


def test_paths_beyond_the_snapshot_build_the_real_processor() -> None:
    """The classic CPU path normalises with the HF image processor's own operation, which the
    snapshot restates for the torchvision backend only, and the ``hf`` transform calls the HF
    processor: the others build it; all equal the real one's output."""
    image = photo_like(np.random.default_rng(3), 97, 140)
    real_hfs = {b: get_adapter_info("qwen2-vl").build_hf_processor(backend=b) for b in BACKENDS}
    ids = real_hfs["pil"].tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    for config, backend, builds in (
        (MultiModalConfig(mm_device_do_normalize=False), "torchvision", False),
        (MultiModalConfig(mm_device_do_normalize=False), "pil", True),
        (MultiModalConfig(transform="hf"), "torchvision", True),
    ):
        stored = build_processor("qwen2-vl", config=config, backend=backend)
        assert not stored.hf_processor.built
        ours = stored.apply(ids, {"image": [image]}).merged_kwargs()
        assert stored.hf_processor.built is builds, (config, backend)
        theirs = build_processor("qwen2-vl", real_hfs[backend], config=config)
        for key, value in theirs.apply(ids, {"image": [image]}).merged_kwargs().items():
            assert torch.equal(ours[key], value), (config, key)
    real_hf = real_hfs["torchvision"]
    # a copy (the hf path's per-thread clone) and a pickle are of the real processor
    stored = build_processor("qwen2-vl")
    assert type(copy.deepcopy(stored.hf_processor)) is type(real_hf)
    assert type(pickle.loads(pickle.dumps(stored.hf_processor))) is type(real_hf)
    assert stored.hf_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == 37
    assert stored.hf_processor.image_processor.size.longest_edge == 1003520
    out = stored.hf_processor.image_processor(images=[image], return_tensors="pt")
    theirs = real_hf.image_processor(images=[image], return_tensors="pt")
    assert torch.equal(out["pixel_values"], theirs["pixel_values"])


def test_under_other_versions_the_first_build_keeps_a_snapshot_in_the_cache_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The shipped snapshot is only for its own versions; under others the first start builds
    the HF processor and keeps its snapshot, which the next start uses."""
    from aiomm.adapters import _stored

    monkeypatch.setattr(_stored, "_versions", lambda: {"transformers": "0", "tokenizers": "0"})
    monkeypatch.setenv("AIOMM_CACHE_DIR", str(tmp_path))
    first = build_processor("qwen2-vl").hf_processor
    assert type(first).__name__ == "Qwen2VLProcessor"
    assert [p.name for p in tmp_path.rglob("*.json")] == ["qwen2-vl--torchvision.json"]
    second = build_processor("qwen2-vl")
    assert isinstance(second.hf_processor, StoredHFProcessor)
    assert second._resolve_params({}) == build_processor("qwen2-vl", first)._resolve_params({})
    ids = second.hf_processor.tokenizer(PROMPTS[0], add_special_tokens=False)
    assert ids == dict(first.tokenizer(PROMPTS[0], add_special_tokens=False))
    assert not second.hf_processor.built
    # no cache folder: built every time; architectures without a snapshot are not cached
    monkeypatch.setenv("AIOMM_CACHE_DIR", "")
    assert type(build_processor("qwen2-vl", backend="pil").hf_processor).__name__ == (
        "Qwen2VLProcessor"
    )
    assert offline_hf_processor("unknown/torchvision", lambda: None) is None
    assert len(list(tmp_path.rglob("*.json"))) == 1


def test_the_embedded_default_starts_without_transformers_or_torchvision() -> None:
    """A fresh process builds the embedded default's engine and serves a request."""
    code = (
        "import sys, anyio, numpy as np\n"
        "from aiomm import Engine, EngineConfig, Request\n"
        "from aiomm.media.samples import encode, photo_like\n"
        "engine = Engine.from_pretrained('qwen2-vl', EngineConfig(device='cpu'))\n"
        "data = encode(photo_like(np.random.default_rng(0), 64, 96))\n"
        "prompt = '<|vision_start|><|image_pad|><|vision_end|> describe'\n"
        "async def main():\n"
        "    async with engine:\n"
        "        r = await engine.process(Request(prompt=prompt, images=[data]))\n"
        "        assert r.ok, r.error\n"
        "anyio.run(main)\n"
        "print(sorted(m for m in ('transformers', 'torchvision', 'torch._dynamo', 'triton')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=Path.home()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
