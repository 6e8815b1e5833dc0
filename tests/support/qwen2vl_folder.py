"""Rebuild, without vLLM, the offline Qwen2-VL model folder the server's golden fixtures were
recorded with (``shared/vllm_probe/qwen2vl_offline.py`` built it for vLLM's render server).

Everything that decides token ids must match that build: the seeded training corpus, the BPE
trainer settings, the vocabulary padded so the special tokens get Qwen2's real ids (151643 on),
the Qwen2 split pattern and the published chat template. ``tests/server`` checks the ids against
the recorded ones, so any drift fails there.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ("build_folder",)

FIRST_SPECIAL_ID = 151643
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VOCAB_WORDS = (
    "the a an of to in and is are was were be been for on with as by at from this that "
    "image picture photo describe what which who where when how why there here it its "
    "you your we our they their he she his her can could would should will may might "
    "please tell me about show find count read text color colour red green blue yellow "
    "black white left right top bottom center middle person people car tree sky road "
    "building water dog cat table chair window door light dark small large big many few "
    "one two three four five six seven eight nine ten first second last next answer "
    "question assistant user system helpful detail details scene object objects number "
    "in the image, describe this picture. what is shown? how many are there?"
).split()

TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _sentences(count: int = 4000, seed: int = 0) -> Any:
    rng = random.Random(seed)
    for _ in range(count):
        words = [rng.choice(VOCAB_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 2048)))
        line = " ".join(words)
        yield line[0].upper() + line[1:] + rng.choice([".", "?", "!", ","])


def _tokenizer_json() -> dict[str, Any]:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=4096,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_sentences(), trainer=trainer)
    data: dict[str, Any] = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    vocab.update({f"<|filler_{i}|>": i for i in range(len(vocab), FIRST_SPECIAL_ID)})
    data["added_tokens"] = [
        {
            "id": FIRST_SPECIAL_ID + i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(SPECIALS)
    ]
    data["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return data


def build_folder(path: Path, *, variant: str = "qwen2_vl") -> Path:
    """Write the folder into ``path`` and return it.

    ``variant="qwen2_5_vl"``: the same tokenizer and template with Qwen2.5-VL-3B's configuration
    (its vision tower's shape; no weights), for the Qwen2.5-VL video fixtures.
    ``variant="qwen3_vl"``: the same tokenizer and template with Qwen3-VL-2B's configuration and
    processor settings (16-px patches, 2 fps video sampling), for the Qwen3-VL video fixtures.
    """
    path.mkdir(parents=True, exist_ok=True)
    vision = {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    }
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": vision,
        "vocab_size": 151936,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    }
    generation = {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "repetition_penalty": 1.0,
        "temperature": 0.01,
        "top_p": 0.001,
        "top_k": 1,
    }
    preprocessor = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    special = {
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(FIRST_SPECIAL_ID + i): {"content": t, **special} for i, t in enumerate(SPECIALS)
        },
        "additional_special_tokens": list(SPECIALS[1:]),
        "bos_token": None,
        "chat_template": TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    files = {
        "config.json": config,
        "generation_config.json": generation,
        "preprocessor_config.json": preprocessor,
        "chat_template.json": {"chat_template": TEMPLATE},
        "tokenizer_config.json": tokenizer_config,
    }
    if variant == "qwen2_5_vl":
        config.update(
            architectures=["Qwen2_5_VLForConditionalGeneration"],
            model_type="qwen2_5_vl",
            hidden_size=2048,
            intermediate_size=11008,
            num_attention_heads=16,
            num_hidden_layers=36,
            max_window_layers=70,
            vision_config={
                "depth": 32,
                "hidden_act": "silu",
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "in_chans": 3,
                "out_hidden_size": 2048,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "spatial_patch_size": 14,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31],
                "tokens_per_second": 2,
                "temporal_patch_size": 2,
            },
        )
        preprocessor["processor_class"] = "Qwen2_5_VLProcessor"
    elif variant == "qwen3_vl":
        _qwen3_vl(config, preprocessor, files)
    elif variant != "qwen2_vl":
        raise ValueError(f"unknown variant {variant!r}")
    for name, obj in files.items():
        (path / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False))
    (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), ensure_ascii=False))
    return path


def _qwen3_vl(config: dict[str, Any], preprocessor: dict[str, Any], files: dict[str, Any]) -> None:
    """Turn the Qwen2-VL files into Qwen3-VL-2B-Instruct's (configuration and processors)."""
    ids = {k: config[k] for k in config if k.endswith("token_id")}
    config.clear()
    config.update(
        architectures=["Qwen3VLForConditionalGeneration"],
        model_type="qwen3_vl",
        **ids,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        text_config={
            "model_type": "qwen3_vl_text",
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_position_embeddings": 32768,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
                "rope_type": "default",
            },
            "rope_theta": 5000000,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 151936,
        },
        vision_config={
            "model_type": "qwen3_vl",
            "deepstack_visual_indexes": [5, 11, 17],
            "depth": 24,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1024,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 4096,
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 2048,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    )
    preprocessor.clear()
    common = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    preprocessor.update(
        common,
        size={"longest_edge": 16777216, "shortest_edge": 65536},
        image_processor_type="Qwen2VLImageProcessorFast",
    )
    files["video_preprocessor_config.json"] = {
        **common,
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
