"""Offline model folders (``aiomm.adapters.folders``): what they hold, how they load, the cache
that ``aiomm serve SHORT_NAME`` uses. The render matrix over every architecture is
``tests/server/test_architectures.py``.

vLLM is not installed here; what vLLM's render server reads of a folder is checked through
transformers: ``config.json`` loads as its family's config class with the tokenizer's token ids and
the processor's patching, the processor files are the ones checkpoints ship (vLLM picks its video
loader from ``video_preprocessor_config.json``), and ``AutoProcessor`` rebuilds the reference
processor parameter for parameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiomm.adapters import folders, from_pretrained, get_adapter_info, supported_adapters
from aiomm.errors import ConfigError, UnknownArchitectureError

ADAPTERS = [info.short_name for info in supported_adapters()]
#: the sub-processors of an HF processor that a checkpoint keeps in files of their own
SUB_PROCESSORS = {
    "image_processor": "preprocessor_config.json",
    "video_processor": "video_preprocessor_config.json",
}


class Folders:
    """Each architecture's offline folder and reference processor, built once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.built:
            self.built[name] = folders.write_model_folder(name, self.root / name)
        return self.built[name]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    return Folders(tmp_path_factory.mktemp("folders"))


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


def test_every_registered_architecture_has_a_config() -> None:
    assert set(folders.CONFIG_SPECS) == set(ADAPTERS)


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_config_loads_as_its_family(name: str, written: Folders) -> None:
    from transformers import AutoConfig

    info, spec = get_adapter_info(name), folders.CONFIG_SPECS[name]
    config = AutoConfig.from_pretrained(written[name])
    assert config.model_type == spec.model_type, name
    assert config.architectures == [info.architecture, *spec.also_architectures], name
    text = config.get_text_config()
    assert text.max_position_embeddings == folders.MAX_POSITION_EMBEDDINGS, name
    raw = json.loads((written[name] / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16", name


def _token_fields(config: dict, prefix: str = "") -> dict[str, object]:
    """Every token-id field of a config dict (``text_config.eos_token_id`` for nested ones)."""
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out.update(_token_fields(value, f"{prefix}{key}."))
        elif key.startswith(("tts_", "codec_")):  # the Omni speech talkers: their codec's ids
            continue
        elif key.endswith(("_token_id", "_token_ids", "_token_index")) and value is not None:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_token_ids_are_the_tokenizers(name: str, written: Folders) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(written[name])
    fields = _token_fields(AutoConfig.from_pretrained(written[name]).to_dict())
    for key, tokens in folders.CONFIG_SPECS[name].token_ids.items():
        want = tokenizer.convert_tokens_to_ids(tokens)
        assert fields.get(key) == want, (name, key, tokens)
    # no id left from the published vocabulary (a config class default the spec misses)
    assert set(fields) == set(folders.CONFIG_SPECS[name].token_ids), name


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_vision_config_patches_as_the_processor(name: str, written: Folders) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(written[name])
    vision = getattr(config, "vision_config", None)
    if hasattr(config, "thinker_config"):  # Qwen2.5-Omni: the thinker's vision tower
        vision = config.thinker_config.vision_config
    reference = get_adapter_info(name).build_hf_processor(backend="torchvision")
    image = getattr(reference, "image_processor", None)
    if type(reference).__name__ == "PaddleOCRVLProcessor":  # one frame: no temporal patch
        assert vision.patch_size == image.patch_size, name
        assert vision.spatial_merge_size == image.merge_size, name
    elif type(reference).__name__ == "Kimi_K25Processor":  # MoonViT: patches merged 2 x 2
        assert vision.patch_size == image.patch_size, name
        assert list(vision.merge_kernel_size) == [image.merge_size] * 2, name
    elif hasattr(image, "merge_size"):  # Qwen-VL and GLM-V: the processor's patching is vLLM's
        assert vision.patch_size == image.patch_size, name
        assert vision.spatial_merge_size == image.merge_size, name
        assert vision.temporal_patch_size == image.temporal_patch_size, name
    elif hasattr(reference, "spatial_merge_size"):  # Pixtral
        assert vision.patch_size == reference.patch_size, name
        assert config.spatial_merge_size == reference.spatial_merge_size, name
    elif hasattr(image, "crop_to_patches"):  # InternVL: the tile and its tokens
        assert list(vision.image_size) == [image.size.height, image.size.width], name
        patches = (vision.image_size[0] // vision.patch_size[0]) ** 2
        assert int(patches * config.downsample_ratio**2) == reference.image_seq_length, name
    elif hasattr(image, "max_patches"):  # Llama 4: the tile and its patches
        assert vision.patch_size == reference.patch_size, name
        assert vision.image_size == image.size.height, name
    elif hasattr(reference, "image_seq_length") and hasattr(config, "mm_tokens_per_image"):
        # Gemma 3: one SigLIP image of the processor's size, pooled to its soft tokens
        assert vision.image_size == image.size.height == image.size.width, name
        assert config.mm_tokens_per_image == reference.image_seq_length, name
    elif hasattr(image, "image_grid_pinpoints"):  # LLaVA-NeXT, OneVision: the anyres grid
        assert config.image_grid_pinpoints == image.image_grid_pinpoints, name
        patch = image.crop_size.height if image.crop_size else image.size.height
        assert vision.image_size == patch, name
    elif hasattr(image, "max_image_size"):  # Idefics3: the sub-image and its tokens
        assert vision.image_size == image.max_image_size["longest_edge"], name
        patches = (vision.image_size // vision.patch_size) ** 2
        assert patches // config.scale_factor**2 == reference.image_seq_len, name
    elif hasattr(reference, "base_size"):  # DeepSeek-OCR 2: the global view is the encoder's
        assert vision.image_size == reference.base_size, name
        assert vision.patch_size == reference.patch_size, name
    elif hasattr(image, "pooling_kernel_size"):  # Gemma 4: patches, pooling, soft tokens
        assert vision.patch_size == image.patch_size, name
        assert vision.pooling_kernel_size == image.pooling_kernel_size, name
        assert vision.default_output_length == image.max_soft_tokens, name
    elif vision is not None:  # Llama Nemotron VL: the tiling parameters
        assert vision.patch_size == reference.patch_size, name
        assert config.force_image_size == reference.image_size, name


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_processor_files_are_the_checkpoints(name: str, written: Folders) -> None:
    reference = get_adapter_info(name).build_hf_processor(backend="torchvision")
    folder = written[name]
    for attribute, filename in SUB_PROCESSORS.items():
        sub = getattr(reference, attribute, None)
        assert (folder / filename).is_file() == (sub is not None), (name, filename)
        if sub is not None:
            saved = json.loads((folder / filename).read_text())
            assert saved["processor_class"] == type(reference).__name__, name
            kind = "image_processor_type" if attribute == "image_processor" else attribute + "_type"
            # vLLM picks its video loader by this name (GLM-OCR: GLM-4.6V's)
            assert saved[kind] == type(sub).__name__, (name, kind)
    composite = folder / "processor_config.json"
    if composite.is_file():  # only the processor's own parameters
        assert not set(json.loads(composite.read_text())) & set(SUB_PROCESSORS), name
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in folder.iterdir()
    }, name


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_the_tokenizer_loads_as_saved(name: str, trust_remote_code: bool, written: Folders) -> None:
    """``AutoTokenizer`` gives the offline tokenizer back, also where the ``model_type`` names a
    tokenizer class that would rebuild it (those folders pin theirs: ``pin_tokenizer``)."""
    from transformers import AutoTokenizer

    from aiomm.adapters.offline import PROMPT_WORDS

    reference = get_adapter_info(name).build_hf_processor(backend="torchvision").tokenizer
    loaded = AutoTokenizer.from_pretrained(written[name], trust_remote_code=trust_remote_code)
    text = " ".join([*PROMPT_WORDS, *reference.all_special_tokens])
    assert loaded.encode(text) == reference.encode(text), name
    assert len(loaded) == len(reference), name
    pinned = (written[name] / "tokenization_offline.py").is_file()
    assert pinned == (folders.CONFIG_SPECS[name].model_type in _REBUILT_TOKENIZERS), name


#: the model types whose registered tokenizer class transformers loads whatever the folder says
_REBUILT_TOKENIZERS = {"qwen3_5", "qwen3_5_moe", "qwen4_exp"}


def test_glm_ocr_ships_glm_4_6v_video_processor(written: Folders) -> None:
    saved = json.loads((written["glm-ocr"] / "video_preprocessor_config.json").read_text())
    assert saved["video_processor_type"] == "Glm46VVideoProcessor"


@pytest.mark.parametrize("name", ADAPTERS)
def test_auto_processor_reproduces_the_reference(name: str, written: Folders) -> None:
    info = get_adapter_info(name)
    reference = info.build_hf_processor(backend="torchvision")
    loaded = from_pretrained(written[name]).hf_processor
    assert type(loaded) is type(reference), name
    if not hasattr(reference, "to_dict"):  # Llama Nemotron VL: the published parameters
        assert {**vars(loaded), "tokenizer": None} == {**vars(reference), "tokenizer": None}
        return
    # every parameter of the processor and of its image and video processors
    assert loaded.to_dict() == reference.to_dict(), name
    for attribute in SUB_PROCESSORS:
        sub = getattr(reference, attribute, None)
        assert type(getattr(loaded, attribute, None)) is type(sub), (name, attribute)


def test_the_pil_backend_loads_from_the_image_processor_file(written: Folders) -> None:
    reference = get_adapter_info("qwen3-vl").build_hf_processor(backend="pil")
    loaded = from_pretrained(written["qwen3-vl"], backend="pil").hf_processor
    assert type(loaded.image_processor) is type(reference.image_processor)
    assert loaded.image_processor.to_dict() == reference.image_processor.to_dict()


def test_remote_code_checkpoints_load_as_the_family_vllm_reads(written: Folders) -> None:
    """Intern-S and Llama Nemotron VL checkpoints name a ``model_type`` of their own (remote code);
    the folders name the config family vLLM's implementation reads, and vLLM's name of the
    Nemotron embedder follows aiomm's."""
    remote = {n for n, spec in folders.CONFIG_SPECS.items() if spec.hub_model_type}
    assert remote == {
        "intern-s1-pro", "intern-s2-mobius", "llama-nemotron-vl-embed", "llama-nemotron-vl-rerank"
    }  # fmt: skip
    config = json.loads((written["llama-nemotron-vl-embed"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaNemotronVLForEmbedding", "LlamaNemotronVLModel"]
    assert from_pretrained(written["llama-nemotron-vl-embed"]).ref.max_dynamic_patch == 6


def test_a_tokenizer_without_a_configured_token_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = folders.CONFIG_SPECS["qwen2-vl"]
    bad = folders.ConfigSpec(spec.model_type, spec.values, {"image_token_id": "<|no_such|>"})
    monkeypatch.setitem(folders.CONFIG_SPECS, "qwen2-vl", bad)
    with pytest.raises(ConfigError, match="no_such"):
        folders.write_model_folder("qwen2-vl", tmp_path / "q")


def test_a_folder_of_an_older_format_is_not_reused(tmp_path: Path) -> None:
    from aiomm import __version__

    stale = tmp_path / "models" / f"qwen2-vl-{__version__}"  # the first format's name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    folder = folders.model_folder("qwen2-vl", tmp_path)
    assert folder != stale and folder.name.endswith(f"-f{folders.FOLDER_FORMAT}")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2_vl"
