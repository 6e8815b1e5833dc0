"""Offline model folders (``aiomm.adapters.folders``): what they hold, how they load, the cache
that ``aiomm serve SHORT_NAME`` uses. The render matrix over every architecture is
``tests/server/test_architectures.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiomm.adapters import folders, from_pretrained, get_adapter_info, supported_adapters
from aiomm.errors import ConfigError, UnknownArchitectureError


def test_every_registered_architecture_has_a_family_template() -> None:
    for info in supported_adapters():
        family = type(info.build_hf_processor(backend="torchvision")).__name__
        assert family in folders.CHAT_TEMPLATES, info.short_name


def test_a_folder_loads_as_its_architecture(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = folders.write_model_folder("mistral3", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Mistral3ForConditionalGeneration"]
    processor = from_pretrained(folder)
    assert type(processor) is get_adapter_info("mistral3").processor_cls
    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}],
        tokenize=False,
    )
    assert text == "<s>[INST][IMG]describe[/INST]"


def test_nemotron_folder_reads_its_tiling_parameters(tmp_path: Path) -> None:
    folder = folders.write_model_folder("llama-nemotron-vl-embed", tmp_path / "n")
    config = json.loads((folder / "config.json").read_text())
    assert config["max_dynamic_patch"] == 6 and config["force_image_size"] == 512
    config["max_dynamic_patch"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    processor = from_pretrained(folder)
    assert processor.ref.max_dynamic_patch == 2
    assert processor.ref.image_size == 512 and processor.ref.use_thumbnail is True


def test_a_family_without_a_template_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(folders.CHAT_TEMPLATES, "ChameleonProcessor")
    with pytest.raises(ConfigError, match="ChameleonProcessor"):
        folders.write_model_folder("chameleon", tmp_path / "c")


def test_the_cache_builds_once(tmp_path: Path) -> None:
    first = folders.model_folder("qwen2-vl", tmp_path)
    stamp = (first / "config.json").stat().st_mtime_ns
    again = folders.model_folder("Qwen2VLForConditionalGeneration", tmp_path)
    assert again == first and (again / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no scratch left
    with pytest.raises(UnknownArchitectureError):
        folders.model_folder("no-such-model", tmp_path)


def test_the_cache_dir_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOMM_CACHE_DIR", str(tmp_path / "a"))
    assert folders.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("AIOMM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert folders.default_cache_dir() == tmp_path / "x" / "aiomm"
