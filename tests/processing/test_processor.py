"""The processing framework: the four HF stages, fields, errors, registry, local folders."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aiomm.adapters import build_processor, from_pretrained, get_adapter_info, supported_adapters
from aiomm.errors import (
    ItemCountMismatchError,
    PixelValueRoundingError,
    ProcessingError,
    ProcessorKwargsError,
    PromptUpdateError,
    UnknownArchitectureError,
    UnknownModalityError,
)
from aiomm.media.samples import photo_like
from aiomm.processing.fields import (
    MultiModalFieldConfig,
    concat_parts,
    merge_items,
    split_items,
)
from aiomm.processing.processor import MultiModalConfig, check_uint8_exact

PH = "<|vision_start|><|image_pad|><|vision_end|>"


@functools.cache
def hf(name: str = "qwen2-vl", backend: str = "torchvision") -> Any:
    return get_adapter_info(name).build_hf_processor(backend=backend)


def images(n: int, seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [photo_like(rng, 60 + 17 * i, 90 + 31 * i) for i in range(n)]


def ids(text: str) -> list[int]:
    return hf().tokenizer(text)["input_ids"]


def test_registry_lists_the_qwen_family_with_defaults() -> None:
    names = {i.short_name: i for i in supported_adapters()}
    for short in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5", "qwen3.5-moe",
                  "qwen4-exp"):  # fmt: skip
        assert names[short].mm_device_do_normalize is True
        assert get_adapter_info(names[short].architecture) is names[short]


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(UnknownArchitectureError) as info:
        get_adapter_info("LlavaForConditionalGeneration")
    message = str(info.value)
    assert "LlavaForConditionalGeneration" in message
    assert (
        "Qwen2VLForConditionalGeneration" in message
        and "Qwen4ExpForConditionalGeneration" in message
    )


def test_more_images_than_placeholders() -> None:
    proc = build_processor("qwen2-vl", hf())
    with pytest.raises(ItemCountMismatchError) as info:
        proc.apply(ids(f"describe {PH}"), {"image": images(2)})
    assert info.value.num_items == 2 and info.value.num_placeholders == 1
    assert "2 image item(s)" in str(info.value)


def test_fewer_images_than_placeholders() -> None:
    proc = build_processor("qwen2-vl", hf())
    with pytest.raises(ItemCountMismatchError):
        proc.apply(ids(f"describe {PH} and {PH} and {PH}"), {"image": images(2)})


def test_unknown_modality() -> None:
    proc = build_processor("qwen2-vl", hf())
    with pytest.raises(UnknownModalityError, match=r"'audio'.*\['image', 'video'\]"):
        proc.apply(ids(f"describe {PH}"), {"image": images(1), "audio": [np.zeros(16000)]})


def test_prompt_without_any_placeholder() -> None:
    proc = build_processor("qwen2-vl", hf())
    with pytest.raises((ItemCountMismatchError, PromptUpdateError)):
        proc.apply(ids("describe the image"), {"image": images(1)})


@pytest.mark.parametrize("transform", ["hf", "native"])
def test_bad_processor_kwargs(transform: str) -> None:
    proc = build_processor("qwen2-vl", hf(), config=MultiModalConfig(transform=transform))
    with pytest.raises(ProcessorKwargsError, match="not_a_kwarg"):
        proc.apply(ids(f"describe {PH}"), {"image": images(1)}, {"not_a_kwarg": 1})


def test_bad_kwarg_value_is_a_processing_error() -> None:
    proc = build_processor("qwen2-vl", hf(), config=MultiModalConfig(transform="hf"))
    with pytest.raises(ProcessingError):
        proc.apply(ids(f"describe {PH}"), {"image": images(1)}, {"size": {"height": 5}})


def test_extreme_aspect_ratio_is_a_processing_error() -> None:
    proc = build_processor("qwen2-vl", hf(), config=MultiModalConfig(transform="native"))
    with pytest.raises(ProcessingError, match="aspect ratio"):
        proc.apply(ids(f"describe {PH}"), {"image": [np.zeros((1, 300, 3), np.uint8)]})


@pytest.mark.parametrize("transform", ["hf", "native"])
def test_processor_kwargs_change_the_output(transform: str) -> None:
    proc = build_processor("qwen2-vl", hf(), config=MultiModalConfig(transform=transform))
    img = images(1, seed=3)
    small = proc.apply(ids(f"x {PH}"), {"image": img}, {"max_pixels": 56 * 56})
    grid = small.merged_kwargs()["image_grid_thw"][0].tolist()
    assert grid[1] * grid[2] * 14 * 14 <= 56 * 56
    ref = hf()(images=img, size={"shortest_edge": 3136, "longest_edge": 56 * 56},
               do_rescale=False, do_normalize=False, return_tensors="pt")  # fmt: skip
    assert torch.equal(small.merged_kwargs()["pixel_values"], ref["pixel_values"])


def test_uint8_output_is_proven_exact() -> None:
    assert check_uint8_exact("pv", torch.tensor([0.0, 255.0, 7.0])).dtype == torch.uint8
    with pytest.raises(PixelValueRoundingError, match="pv"):
        check_uint8_exact("pv", torch.tensor([0.5, 1.0]))
    with pytest.raises(PixelValueRoundingError):
        check_uint8_exact("pv", torch.tensor([256.0]))


def test_dummy_text_and_truncation_only_with_text() -> None:
    proc = build_processor("qwen2-vl", hf())
    data, kwargs, passthrough = proc._get_hf_mm_inputs({"image": images(2)}, {})
    assert data["text"] == [PH * 2] and kwargs["truncation"] is False
    assert kwargs["do_rescale"] is False and kwargs["do_normalize"] is False
    assert passthrough == {}

    class NoText(type(proc)):
        dummy_inputs = None  # an HF processor called without text

    data, kwargs, _ = NoText(hf())._get_hf_mm_inputs({"image": images(1), "audio": [1]}, {})
    assert "text" not in data and "truncation" not in kwargs
    assert "audio" in data and "audios" not in data  # renamed centrally


def test_finalize_creates_empty_output_and_merges_passthrough() -> None:
    proc = build_processor("qwen2-vl", hf())
    assert proc._finalize_hf_mm_data(None, {}) == {}
    assert proc._finalize_hf_mm_data({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}


def test_no_images_leaves_prompt_alone() -> None:
    proc = build_processor("qwen2-vl", hf())
    prompt = ids("describe the image")
    out = proc.apply(prompt, {"image": []})
    assert out.prompt_token_ids == prompt and out.mm_kwargs == {}


def test_prompt_already_expanded_is_not_expanded_twice() -> None:
    proc = build_processor("qwen2-vl", hf())
    img = images(1)
    first = proc.apply(ids(f"describe {PH}"), {"image": img})
    again = proc.apply(first.prompt_token_ids, {"image": img})
    assert again.prompt_token_ids == first.prompt_token_ids
    assert again.mm_placeholders == first.mm_placeholders


def test_fields_split_and_merge_round_trip() -> None:
    proc = build_processor("qwen2-vl", hf())
    out = proc.apply(ids(f"a {PH} b {PH} c {PH}"), {"image": images(3)})
    items = out.mm_kwargs["image"]
    assert len(items) == 3
    for item in items:
        grid = item.data["image_grid_thw"]
        assert item.data["pixel_values"].shape[0] == int(grid.prod())
        assert item.nbytes() == item.data["pixel_values"].nbytes + grid.nbytes
    merged = merge_items(items)
    again = split_items(merged, items[0].fields | {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes(
            "image", merged["image_grid_thw"].prod(-1)
        )
    })  # fmt: skip
    for a, b in zip(items, again["image"], strict=True):
        # items hold one frame; merged rows repeat it (the model's rows)
        full = a.fields["pixel_values"].expanded(a.data["pixel_values"]).flatten(1)
        assert torch.equal(full, b.data["pixel_values"])
    # items reused in another order merge to the other order
    swapped = merge_items([items[2], items[0]])
    assert torch.equal(swapped["image_grid_thw"][0], items[2].data["image_grid_thw"])


def test_concat_parts_concatenate_to_the_merge() -> None:
    cfg = {
        "flat": MultiModalFieldConfig.flat_from_sizes("image", [2, 1, 3]),
        "batched": MultiModalFieldConfig.batched("image"),
        "shared": MultiModalFieldConfig.shared("image", 3),
        "names": MultiModalFieldConfig.batched("image"),
    }
    outputs = {
        "flat": torch.arange(6 * 4).reshape(6, 4),
        "batched": torch.arange(3 * 5).reshape(3, 5),
        "shared": torch.ones(2),
        "names": ["a", "b", "c"],
    }
    items = split_items(outputs, cfg)["image"]
    merged = merge_items(items)
    for key in ("flat", "batched"):
        parts = concat_parts(items, key)
        assert parts is not None and parts.repeat is None
        assert torch.equal(torch.cat(parts.tensors), merged[key])
    assert concat_parts(items, "shared") is None and concat_parts(items, "names") is None
    assert concat_parts(items, "missing") is None
    assert set(merge_items(items, skip=("flat",))) == {"batched", "shared", "names"}
    ragged = split_items({"b": [torch.ones(2), torch.ones(3)]}, {"b": cfg["batched"]})["image"]
    with pytest.raises(ProcessingError, match="different shapes"):
        concat_parts(ragged, "b")


def test_compact_rows_expand_when_merged() -> None:
    """``repeat=(blocks, times)``: items keep compact rows; merging repeats each block."""
    cfg = MultiModalFieldConfig.flat_from_sizes("image", [2, 3], repeat=(3, 2))
    compact = torch.arange(5 * 3 * 4).reshape(5, 12)  # 5 rows of 3 blocks of width 4
    items = split_items({"pixel_values": compact}, {"pixel_values": cfg})["image"]
    assert [it.data["pixel_values"].shape[0] for it in items] == [2, 3]
    assert items[0].nbytes() == compact[:2].nbytes  # the cache holds the compact rows
    merged = merge_items(items)["pixel_values"]
    blocks = compact.reshape(5, 3, 1, 4)
    want = torch.cat([blocks, blocks], dim=2).reshape(5, 24)  # each block twice, in place
    assert torch.equal(merged, want)
    parts = concat_parts(items, "pixel_values")
    assert parts is not None and parts.repeat == (3, 2)
    assert torch.equal(torch.cat([cfg.expanded(t).flatten(1) for t in parts.tensors]), want)
    assert MultiModalFieldConfig.flat_from_sizes("image", [1], repeat=(3, 1)).repeat is None
    with pytest.raises(ProcessingError, match="equal blocks"):
        cfg.expanded(torch.zeros(2, 7))
    with pytest.raises(ProcessingError, match="repeat"):
        MultiModalFieldConfig.flat_from_sizes("image", [1], repeat=(0, 2))


def test_shared_and_bad_flat_fields() -> None:
    cfg = {
        "x": MultiModalFieldConfig.shared("image", 2),
        "y": MultiModalFieldConfig.batched("image"),
    }
    items = split_items({"x": torch.ones(3), "y": torch.arange(2)}, cfg)["image"]
    assert len(items) == 2 and torch.equal(merge_items(items)["x"], torch.ones(3))
    with pytest.raises(ProcessingError, match="rows"):
        split_items(
            {"z": torch.ones(5)}, {"z": MultiModalFieldConfig.flat_from_sizes("image", [2, 2])}
        )
    with pytest.raises(ProcessingError, match="disagree"):
        split_items(
            {"a": torch.ones(2), "b": torch.ones(3)},
            {
                "a": MultiModalFieldConfig.batched("image"),
                "b": MultiModalFieldConfig.batched("image"),
            },
        )


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_from_pretrained_local_folder(tmp_path: Path, backend: str) -> None:
    reference = hf("qwen3-vl", backend)
    reference.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl"})
    )
    kwargs = {"backend": "pil"} if backend == "pil" else {}
    proc = from_pretrained(tmp_path, **kwargs)
    assert proc.image_processor.patch_size == 16
    assert proc.backend.value == backend
    img = images(2, seed=5)
    text = f"describe {PH} and {PH}"
    out = proc.apply(reference.tokenizer(text)["input_ids"], {"image": img})
    ref = reference(text=[text], images=img, do_rescale=False, do_normalize=False,
                    return_tensors="pt")  # fmt: skip
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(out.merged_kwargs()["pixel_values"], ref["pixel_values"].to(torch.uint8))


def test_from_pretrained_without_config_needs_architecture(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="architecture="):
        from_pretrained(tmp_path)


def test_native_requires_an_adapter_with_one() -> None:
    proc = build_processor("qwen2-vl", hf(), config=MultiModalConfig(transform="auto"))
    assert proc.transform == "native"
    with pytest.raises(ValueError, match="transform"):
        MultiModalConfig(transform="fast")


def test_every_architecture_is_listed_with_its_defaults() -> None:
    infos = supported_adapters()
    assert len(infos) == 31
    assert len({i.architecture for i in infos}) == 31 and len({i.short_name for i in infos}) == 31
    defaults = {i.short_name: i.mm_device_do_normalize for i in infos}
    # the models whose vLLM implementation takes normalised pixels (or HF's bfloat16 ones)
    host_normalized = {
        "chameleon", "gemma3", "gemma4", "idefics3", "smolvlm", "internvl", "llava-next",
        "llava-onevision", "llama4", "paddleocr-vl", "deepseek-ocr-2", "deepseek-ocr",
    }  # fmt: skip
    # and the audio models (float features, no pixels)
    host_normalized |= {"qwen2-audio"}
    # vLLM's Qwen2.5-Omni and Qwen3-Omni thinkers take normalised pixels
    host_normalized |= {"qwen2.5-omni", "qwen3-omni"}
    assert {name for name, on in defaults.items() if not on} == host_normalized
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for info in infos:  # the README's support table shows every one
        assert f"`{info.short_name}` | `{info.architecture}`" in readme
