"""The adapter registry: discovery, order, lookups, and bad registrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiomm.adapters import get_adapter_info, supported_adapters
from aiomm.adapters.qwen_vl import QWEN3, QwenVLProcessor
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ConfigError, UnknownArchitectureError

#: every supported short name and its architecture (README's table)
EXPECTED = {
    "qwen2-vl": "Qwen2VLForConditionalGeneration",
    "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3-vl": "Qwen3VLForConditionalGeneration",
    "qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3.5": "Qwen3_5ForConditionalGeneration",
    "qwen3.5-moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen4-exp": "Qwen4ExpForConditionalGeneration",
    "glm-4v": "Glm4vForConditionalGeneration",
    "glm-5-next": "Glm5NextForConditionalGeneration",
    "glm-ocr": "GlmOcrForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "intern-s1-pro": "InternS1ProForConditionalGeneration",
    "intern-s2-mobius": "InternS2MobiusForConditionalGeneration",
    "llama-nemotron-vl-embed": "LlamaNemotronVLForEmbedding",
    "llama-nemotron-vl-rerank": "LlamaNemotronVLForSequenceClassification",
    "chameleon": "ChameleonForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "llava-next": "LlavaNextForConditionalGeneration",
    "llava-onevision": "LlavaOnevisionForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "paddleocr-vl": "PaddleOCRVLForConditionalGeneration",
    "deepseek-ocr-2": "DeepseekOCR2ForCausalLM",
    "deepseek-ocr": "DeepseekOCRForCausalLM",
    "kimi-k2.5": "KimiK25ForConditionalGeneration",
    "qwen2-audio": "Qwen2AudioForConditionalGeneration",
    "qwen2.5-omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3-omni": "Qwen3OmniMoeForConditionalGeneration",
}


def test_every_builtin_module_is_discovered_and_both_names_resolve() -> None:
    infos = supported_adapters()
    assert {i.short_name: i.architecture for i in infos} == EXPECTED
    for info in infos:
        assert get_adapter_info(info.short_name) is info
        assert get_adapter_info(info.architecture) is info
        assert info.build_hf_processor is not None and info.example_models


def test_order_is_by_module_then_registration() -> None:
    modules = [i.processor_cls.__module__ for i in supported_adapters()]
    assert modules == sorted(modules)
    names = [i.short_name for i in supported_adapters()]
    # registration order within a module: the Qwen rows as written, the Intern-S rows last
    qwen = [n for n in names if get_adapter_info(n).processor_cls is QwenVLProcessor]
    assert qwen == [*list(EXPECTED)[:7], "intern-s1-pro", "intern-s2-mobius"]
    assert supported_adapters() == supported_adapters()


def test_device_normalize_defaults() -> None:
    defaults = {i.short_name: i.mm_device_do_normalize for i in supported_adapters()}
    assert defaults.pop("chameleon") is False
    assert defaults.pop("gemma3") is False  # vLLM's Gemma 3 takes normalised pixels
    assert defaults.pop("gemma4") is False  # vLLM's Gemma 4 takes rescaled pixels
    assert defaults.pop("llama4") is False  # HF normalises in bfloat16, as vLLM sends it
    assert defaults.pop("idefics3") is False  # vLLM's Idefics3 takes normalised pixels
    assert defaults.pop("smolvlm") is False  # vLLM's SmolVLM is its Idefics3
    assert defaults.pop("paddleocr-vl") is False  # vLLM's PaddleOCR-VL takes normalised pixels
    assert defaults.pop("deepseek-ocr-2") is False  # vLLM's DeepSeek-OCR 2: normalised pixels
    assert defaults.pop("deepseek-ocr") is False  # and DeepSeek-OCR's
    assert defaults.pop("qwen2-audio") is False  # float log-mel features: nothing to normalise
    assert defaults.pop("qwen2.5-omni") is False  # vLLM's Qwen2.5-Omni: normalised pixels
    assert defaults.pop("qwen3-omni") is False  # and Qwen3-Omni's
    # vLLM's models for these take normalised pixels (no mm_device_do_normalize)
    for name in ("internvl", "llava-next", "llava-onevision"):
        assert defaults.pop(name) is False, name
    assert all(defaults.values())


def test_unknown_names_list_the_supported_ones() -> None:
    for name in ("InternS1ForConditionalGeneration", "LlamaNemotronVLForCausalLM", "qwen5"):
        with pytest.raises(UnknownArchitectureError) as info:
            get_adapter_info(name)
        assert name in str(info.value) and "InternS1ProForConditionalGeneration" in str(info.value)


@pytest.mark.parametrize("taken", ["qwen2-vl", "Glm4vForConditionalGeneration"])
def test_a_taken_name_is_refused_and_nothing_is_registered(taken: str) -> None:
    before = supported_adapters()

    def build(**_: Any) -> Any:
        raise AssertionError("never built")

    class Clash(QwenVLProcessor):
        pass

    decorate = register(
        Architecture("fresh-vl", "FreshVLForConditionalGeneration", build),
        Architecture(taken, f"{taken}-arch", build)
        if not taken[0].isupper()
        else Architecture("fresh-2", taken, build),
    )
    with pytest.raises(ConfigError, match=f"{taken!r} is registered twice"):
        decorate(Clash)
    assert supported_adapters() == before
    with pytest.raises(UnknownArchitectureError):
        get_adapter_info("fresh-vl")


def test_a_row_naming_itself_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="registered twice"):
        register(
            Architecture("twin", "TwinForCausalLM", QWEN3),
            Architecture("TwinForCausalLM", "Twin2ForCausalLM", QWEN3),
        )(QwenVLProcessor)
    with pytest.raises(UnknownArchitectureError):
        get_adapter_info("twin")


def test_an_alias_selects_its_row_and_a_real_checkpoints_folder_loads(tmp_path: Path) -> None:
    """Llama Nemotron VL's embedder checkpoint names itself ``LlamaNemotronVLModel``."""
    import json

    from aiomm.adapters import from_pretrained
    from aiomm.adapters.folders import write_model_folder

    info = get_adapter_info("LlamaNemotronVLModel")
    assert info.short_name == "llama-nemotron-vl-embed"
    folder = write_model_folder("llama-nemotron-vl-embed", tmp_path / "embed")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaNemotronVLModel"]  # as the checkpoint ships it
    (folder / "config.json").write_text(json.dumps(config))
    assert type(from_pretrained(folder)) is info.processor_cls
    with pytest.raises(ConfigError, match="registered twice"):
        register(Architecture("twin-3", "Twin3ForCausalLM", QWEN3, aliases=("qwen2-vl",)))(
            QwenVLProcessor
        )
