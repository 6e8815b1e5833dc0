"""Offline model folders for every registered architecture: what ``aiomm serve`` and
``Engine.from_pretrained(folder)`` read, written without a model hub.

:func:`write_model_folder` saves the architecture's reference HF processor (``build_hf_processor``:
the word-level tokenizer of :mod:`aiomm.adapters.offline` with the model's real special tokens, and
the image processor's documented parameters) with ``save_pretrained``, the model family's chat
template, and a minimal ``config.json`` naming the architecture. No weights and no
``generation_config.json`` (sampling falls back to vLLM's defaults). :func:`model_folder` builds
one into a cache directory once, for ``aiomm serve SHORT_NAME``.

The chat templates are the families' published ones reduced to what a render request uses (roles,
text and images in order; no tools, no reasoning switches), each writing the image placeholder the
family's HF processor expands:

- Qwen2-VL / Qwen2.5-VL: ChatML with the default system prompt, an image as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (``Qwen/Qwen2-VL-2B-Instruct``'s template);
- Qwen3-VL and later, Intern-S: the same ChatML without a default system prompt
  (``Qwen/Qwen3-VL-2B-Instruct``);
- GLM-4.1V, GLM-OCR, GLM-5-Next: ``[gMASK]<sop>``, ``<|role|>\\n`` turns, an image as
  ``<|begin_of_image|><|image|><|end_of_image|>``, a video as
  ``<|begin_of_video|><|video|><|end_of_video|>`` (``zai-org/GLM-4.1V-9B-Thinking``);
- Mistral 3 (Pixtral processor): ``<s>``, ``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]``,
  ``[INST]...[/INST]`` with ``[IMG]`` per image, assistant turns ending ``</s>``
  (``mistralai/Mistral-Small-3.1-24B-Instruct-2503``);
- Chameleon: ``USER: ``/``ASSISTANT:`` turns with ``<image>`` per image, the LLaVA-style template
  transformers' Chameleon examples use (the processor itself appends the ``<reserved08706>``
  separator in chat mode);
- Llama Nemotron VL: Llama 3's header template with ``<image>`` per image.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from aiomm.adapters._stored import cache_dir, user_cache_dir
from aiomm.adapters.registry import get_adapter_info
from aiomm.errors import ConfigError

__all__ = ("CHAT_TEMPLATES", "default_cache_dir", "model_folder", "write_model_folder")

_QWEN_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
)
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n" + _QWEN_CONTENT + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    + _QWEN_CONTENT
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif content['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MISTRAL3_TEMPLATE = (
    "<s>{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}[IMG]"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[/INST]"
    "{% elif message['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
)
CHAMELEON_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAMA3_VL_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: the family chat template of each reference processor class (by class name)
CHAT_TEMPLATES: dict[str, str] = {
    "Qwen2VLProcessor": QWEN2_VL_TEMPLATE,
    "Qwen2_5_VLProcessor": QWEN2_VL_TEMPLATE,
    "Qwen3VLProcessor": QWEN3_VL_TEMPLATE,
    "Glm4vProcessor": GLM_TEMPLATE,
    "Glm46VProcessor": GLM_TEMPLATE,
    "Glm5NextProcessor": GLM_TEMPLATE,
    "PixtralProcessor": MISTRAL3_TEMPLATE,
    "ChameleonProcessor": CHAMELEON_TEMPLATE,
    "NemotronVLReference": LLAMA3_VL_TEMPLATE,
}

#: the context length written into every offline ``config.json``
MAX_POSITION_EMBEDDINGS = 32768


def write_model_folder(name: str, path: str | Path, *, backend: str = "torchvision") -> Path:
    """Write the offline model folder of architecture or short name ``name`` into ``path``.

    :raises UnknownArchitectureError: no adapter has that name.
    :raises ConfigError: the architecture's reference processor has no family chat template here.
    """
    info = get_adapter_info(name)
    hf_processor = info.build_hf_processor(backend=backend)
    family = type(hf_processor).__name__
    template = CHAT_TEMPLATES.get(family)
    if template is None:
        raise ConfigError(
            f"no chat template for {info.short_name}'s reference processor {family}; add its "
            "family's template to aiomm.adapters.folders.CHAT_TEMPLATES"
        )
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf_processor.tokenizer.chat_template = template
    if hasattr(hf_processor, "chat_template"):
        hf_processor.chat_template = template
    hf_processor.save_pretrained(str(folder))
    config: dict[str, Any] = {
        "architectures": [info.architecture],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "torch_dtype": "bfloat16",
    }
    entries = getattr(hf_processor, "config_entries", None)
    if entries is not None:
        config.update(entries())
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def default_cache_dir() -> Path:
    """aiomm's cache folder (:func:`aiomm.adapters._stored.cache_dir`); where an empty
    ``AIOMM_CACHE_DIR`` keeps no processor snapshots, model folders still need one: the
    user's cache folder."""
    return cache_dir() or user_cache_dir()


def model_folder(name: str, cache_dir: str | Path | None = None) -> Path:
    """The offline folder of ``name`` under ``cache_dir`` (:func:`default_cache_dir`), written
    on first use. Safe when several processes build it at once: each writes a private folder
    and the first rename wins.

    :raises UnknownArchitectureError: no adapter has that name.
    :raises ConfigError: the architecture has no family chat template here.
    """
    from aiomm import __version__

    info = get_adapter_info(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / "models" / f"{info.short_name}-{__version__}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{info.short_name}-", dir=folder.parent))
    try:
        write_model_folder(name, scratch)
        try:
            scratch.rename(folder)
        except OSError:  # another process renamed its copy first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
