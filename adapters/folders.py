"""Offline model folders for every registered architecture: what ``aiomm serve``,
``Engine.from_pretrained(folder)`` and vLLM's render server (``vllm launch render FOLDER``) read,
written without a model hub.

A folder holds, as the architecture's published checkpoint lays them out (no weights and no
``generation_config.json``: sampling falls back to vLLM's defaults):

- ``config.json`` (:func:`model_config`): the transformers ``model_type`` and the architecture's
  ``architectures``, the example checkpoint's (``Architecture.example_models``) structure in
  ``text_config`` / ``vision_config`` as far as the config and the multimodal processor read it
  (:data:`CONFIG_SPECS`; a value not listed there takes the config class's default), every token
  id the config carries (image / video / vision-start tokens, bos / eos / pad) as the id of the
  folder's own tokenizer, ``torch_dtype`` ``bfloat16`` and a context of
  :data:`MAX_POSITION_EMBEDDINGS`, plus the entries the reference processor keeps in
  ``config.json`` (``config_entries()``: Llama Nemotron VL's tiling parameters);
- the reference HF processor (``build_hf_processor``: the word-level tokenizer of
  :mod:`aiomm.adapters.offline` with the model's real special tokens, and the image and video
  processors' documented parameters), saved as checkpoints ship it (:func:`save_processor`):
  ``tokenizer.json`` / ``tokenizer_config.json``, ``chat_template.jinja``,
  ``preprocessor_config.json`` (the image processor and the ``processor_class``),
  ``video_preprocessor_config.json`` where the family has a video processor (vLLM picks its video
  loader from that file's ``video_processor_type``) and ``processor_config.json`` only where the
  processor has parameters of its own (Pixtral, Chameleon);
- where the ``model_type`` would make transformers rebuild the tokenizer as its family's
  (Qwen3.5, Qwen4-Exp, Intern-S2-Mobius), ``tokenization_offline.py`` and an ``auto_map`` that keep
  the saved one (:func:`pin_tokenizer`).

Where a checkpoint's own ``model_type`` needs the configuration code of its repository
(``trust_remote_code``: Intern-S1-Pro, Intern-S2-Mobius, Llama Nemotron VL), the folder names a
transformers family whose config holds the fields vLLM's implementation reads (Qwen3-VL-MoE,
Qwen3.5-MoE, LLaVA; ``ConfigSpec.hub_model_type`` records the checkpoint's), so that it loads
without remote code. vLLM registers Llama
Nemotron VL's embedder as ``LlamaNemotronVLModel`` (the checkpoint's ``architectures``); its
folder lists that name after aiomm's (``ConfigSpec.also_architectures``), the first being the
one :func:`aiomm.adapters.from_pretrained` reads and vLLM taking the first it supports.

:func:`model_folder` builds one into a cache directory once, for ``aiomm serve SHORT_NAME``; the
folder's name carries aiomm's version and :data:`FOLDER_FORMAT`, so a folder of another layout is
never reused.

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
- LLaVA-NeXT: ``[INST] `` turns with the images first (``<image>\\n`` each), then the text,
  `` [/INST]`` (``llava-hf/llava-v1.6-mistral-7b-hf``);
- LLaVA-OneVision: ``<|im_start|>role `` turns with the images first (``<image>``), then the
  videos (``<video>``), then each text after a newline, ``<|im_end|>``
  (``llava-hf/llava-onevision-qwen2-7b-ov-hf``).
- Llama 4: ``<|begin_of_text|>``, ``<|header_start|>role<|header_end|>\\n\\n`` turns ending
  ``<|eot|>``, ``<|image|>`` per image (``meta-llama/Llama-4-Scout-17B-16E-Instruct``).
- InternVL 3 / 3.5 (``-hf`` checkpoints): ChatML, an image as ``<IMG_CONTEXT>\\n``
  (``OpenGVLab/InternVL3-1B-hf``'s template without its default system prompt).
- Gemma 3: ``<start_of_turn>user\\n...<end_of_turn>\\n`` turns with ``<start_of_image>`` per image,
  the system prompt prefixed to the first user turn (``google/gemma-3-4b-it``).
- Idefics3: ``<|begin_of_text|>``, ``Role:`` turns (``Role: `` before text) ending
  ``<end_of_utterance>\\n``, ``<image>`` per image (``HuggingFaceM4/Idefics3-8B-Llama3``).
- PaddleOCR-VL: ``<|begin_of_sentence|>``, system text then ``\\n``, ``User: `` turns with the
  images first (``<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>`` each), then the text and
  ``\\n``, ``Assistant: `` turns ending ``<|end_of_sentence|>`` (``PaddlePaddle/PaddleOCR-VL``).
- SmolVLM: Idefics3's turns after ``<|im_start|>`` (``HuggingFaceTB/SmolVLM2-2.2B-Instruct``).
- DeepSeek-OCR and DeepSeek-OCR 2: the BOS, then every message's content without roles, an
  image as ``<image>\\n`` (vLLM's ``template_deepseek_ocr.jinja``; the checkpoints ship none).
- Gemma 4: ``<bos>``, ``<|turn>role\\n...<turn|>\\n`` turns (the assistant is ``model``) with
  ``<|image|>`` per image (``google/gemma-4-E4B-it``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiomm.adapters._cache_dir import default_cache_dir
from aiomm.adapters.registry import get_adapter_info
from aiomm.errors import ConfigError

__all__ = (
    "CHAT_TEMPLATES",
    "CONFIG_SPECS",
    "FOLDER_FORMAT",
    "ConfigSpec",
    "default_cache_dir",
    "model_config",
    "model_folder",
    "pin_tokenizer",
    "save_processor",
    "write_model_folder",
)

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
LLAMA4_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}"
    "<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|image|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
#: llava-hf/llava-v1.6-mistral-7b-hf's: ``[INST] `` with a turn's images first (``<image>\n``
#: each), then its text, `` [/INST]``; a system prompt in ``<<SYS>>`` markers
LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\n' }}{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' }}{% elif message['role'] == 'assistant' %}{{ ' ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{% endfor %}"
)
#: llava-hf/llava-onevision-qwen2-7b-ov-hf's: ``<|im_start|>ROLE `` with a turn's images first
#: (``<image>`` each), then its videos (``<video>``), then each text after a newline,
#: ``<|im_end|>``
LLAVA_ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ '\n' + message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}{{ '<video>' }}{% endif %}{% endfor %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ '\n' + content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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
    # vLLM's template_deepseek_ocr.jinja (DeepSeek-OCR's: the BOS, then every message's content,
    # no roles), an image part written "<image>\n" as vLLM's string content format places it
    "DeepseekOCRReference": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' %}{{ '<image>\\n' }}"
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
        "{% endif %}{% endfor %}"
    ),
    "Llama4Processor": LLAMA4_TEMPLATE,
    # HuggingFaceM4/Idefics3-8B-Llama3's: "Role:" turns ("Role: " before text), each ended by
    # <end_of_utterance>, an image as <image>
    "Idefics3Processor": (
        "<|begin_of_text|>{% for message in messages %}{{ message['role'] | capitalize }}"
        "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
        "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
        "{% else %}{{ ': ' }}{% endif %}{% for line in message['content'] %}"
        "{% if line['type'] == 'text' %}{{ line['text'] }}"
        "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
        "<end_of_utterance>\n{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    ),
    # HuggingFaceTB/SmolVLM2-2.2B-Instruct's: Idefics3's turns after <|im_start|>
    "SmolVLMProcessor": (
        "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
        "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
        "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
        "{% else %}{{ ': ' }}{% endif %}{% for line in message['content'] %}"
        "{% if line['type'] == 'text' %}{{ line['text'] }}"
        "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
        "<end_of_utterance>\n{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    ),
    # google/gemma-4-E4B-it's turns: <bos>, "<|turn>role\n" ... "<turn|>\n", the assistant is
    # "model", text is trimmed, an image as <|image|>, a video as <|video|>
    "Gemma4Processor": (
        "{{ bos_token }}{% for message in messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<|turn>' + role + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] | trim }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '<|image|>' }}"
        "{% elif item['type'] == 'video' %}{{ '<|video|>' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
        "{% endif %}{{ '<turn|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
    ),
    # OpenGVLab/InternVL3-1B-hf's ChatML; its default (Chinese) system prompt is left out
    "InternVLProcessor": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
        "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # google/gemma-3-4b-it's template: a system prompt joins the first user turn, the assistant
    # is "model", text is trimmed
    "Gemma3Processor": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% if messages[0]['content'] is string %}"
        "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
        "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' %}"
        "{% endif %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
        "{% if message['content'] is string %}{{ message['content'] | trim }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
        "{% endif %}"
        "{{ '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    "LlavaNextProcessor": LLAVA_NEXT_TEMPLATE,
    "LlavaOnevisionProcessor": LLAVA_ONEVISION_TEMPLATE,
    # moonshotai/Kimi-K2.5's turns (<|im_role|>role<|im_middle|>...<|im_end|>), an image as
    # <|media_begin|>image<|media_content|><|media_pad|><|media_end|> (vLLM's placeholder)
    "Kimi_K25Processor": (
        "{% for message in messages %}<|im_{{ message['role'] }}|>{{ message['role'] }}"
        "<|im_middle|>{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
        "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    ),
    # PaddlePaddle/PaddleOCR-VL's template: a user turn's images come before its text
    "PaddleOCRVLProcessor": (
        "<|begin_of_sentence|>{% for message in messages %}"
        "{% if message['role'] == 'user' %}User: "
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
        "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>{% endif %}{% endfor %}"
        "{% for content in message['content'] %}{% if content['type'] == 'text' %}"
        "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
        "{% elif message['role'] == 'assistant' %}Assistant: "
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for content in message['content'] %}{% if content['type'] == 'text' %}"
        "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|end_of_sentence|>"
        "{% elif message['role'] == 'system' %}"
        "{% if message['content'] is string %}{{ message['content'] + '\\n' }}{% else %}"
        "{% for content in message['content'] %}{% if content['type'] == 'text' %}"
        "{{ content['text'] + '\\n' }}{% endif %}{% endfor %}{% endif %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    ),
    # Qwen/Qwen2-Audio-7B-Instruct's template
    "Qwen2AudioProcessor": (
        "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        "{% else %}{% for content in message['content'] %}"
        "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
        "{% set audio_count.value = audio_count.value + 1 %}"
        "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
        "<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Qwen/Qwen2.5-Omni-7B's template (its default system turn shortened)
    "Qwen2_5OmniProcessor": (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
        "<|vision_bos|><|IMAGE|><|vision_eos|>"
        "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
        "<|audio_bos|><|AUDIO|><|audio_eos|>"
        "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
        "<|vision_bos|><|VIDEO|><|vision_eos|>"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
        "<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Qwen/Qwen3-Omni-30B-A3B-Instruct's template (its tool and reasoning branches left out)
    "Qwen3OmniMoeProcessor": (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
        "<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
        "<|audio_start|><|audio_pad|><|audio_end|>"
        "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
        "<|vision_start|><|video_pad|><|vision_end|>"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
        "<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}

#: the context length written into every offline ``config.json`` (``max_position_embeddings``:
#: vLLM's and ``aiomm serve``'s ``max_model_len``)
MAX_POSITION_EMBEDDINGS = 32768
#: the layout of the folders :func:`write_model_folder` writes: part of :func:`model_folder`'s
#: cache key (2: real ``config.json`` files and the processor configs checkpoints ship)
FOLDER_FORMAT = 2


@dataclass(frozen=True)
class ConfigSpec:
    """What one architecture's ``config.json`` holds beyond the fields every folder has."""

    #: the transformers config family (``AutoConfig`` reads the folder as it)
    model_type: str
    #: the example checkpoint's values: top-level fields, ``text_config`` and ``vision_config``
    values: Mapping[str, Any]
    #: config field (``"text_config.eos_token_id"`` for a nested one) -> the special token (or
    #: tokens) whose id in the folder's tokenizer it holds
    token_ids: Mapping[str, str | tuple[str, ...]]
    #: the checkpoint's own ``model_type`` where it needs remote code (the folder writes
    #: :attr:`model_type`, a family whose config holds what vLLM reads), else None
    hub_model_type: str | None = None
    #: names vLLM registers the architecture under besides aiomm's (listed after it)
    also_architectures: tuple[str, ...] = ()


_QWEN_TOKEN_IDS: dict[str, str | tuple[str, ...]] = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "text_config.bos_token_id": "<|endoftext|>",
    "text_config.eos_token_id": "<|im_end|>",
}
_GLM_TOKEN_IDS: dict[str, str | tuple[str, ...]] = {
    "image_token_id": "<|image|>",
    "video_token_id": "<|video|>",
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
    "text_config.pad_token_id": "<|endoftext|>",
    "text_config.eos_token_id": ("<|endoftext|>", "<|user|>", "<|observation|>"),
}
_NEMOTRON_TOKEN_IDS: dict[str, str | tuple[str, ...]] = {
    "image_token_index": "<IMG_CONTEXT>",
    "img_context_token_id": "<IMG_CONTEXT>",
    "text_config.bos_token_id": "<|begin_of_text|>",
    "text_config.eos_token_id": "<|end_of_text|>",
}
#: Qwen3-VL's vision tower (patch 16) under each Qwen3-VL-processor checkpoint
_QWEN3_VISION = {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
#: nvidia/llama-nemotron-{embed,rerank}-vl-1b-v2: Llama 3.2 1B as the language model, SigLIP
#: tiles (``config_entries()`` adds the tile size and patch)
_NEMOTRON_VALUES: dict[str, Any] = {
    "text_config": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "vision_config": {"model_type": "siglip_vision_model"},
    # the checkpoints' pooling of the language model's states (vLLM's pooler reads it)
    "pooling": "avg",
}  # fmt: skip

#: each registered architecture's ``config.json`` (by short name)
CONFIG_SPECS: dict[str, ConfigSpec] = {
    "qwen2-vl": ConfigSpec("qwen2_vl", {  # Qwen/Qwen2-VL-2B-Instruct
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
            "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
            "max_window_layers": 28, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [16, 24, 24]},
        },
        "vision_config": {
            "depth": 32, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16,
            "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
    }, _QWEN_TOKEN_IDS),
    "qwen2.5-vl": ConfigSpec("qwen2_5_vl", {  # Qwen/Qwen2.5-VL-3B-Instruct
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
            "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
            "max_window_layers": 70, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [16, 24, 24]},
        },
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
            "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        },
    }, _QWEN_TOKEN_IDS),
    "qwen3-vl": ConfigSpec("qwen3_vl", {  # Qwen/Qwen3-VL-4B-Instruct
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        },
        "vision_config": {
            **_QWEN3_VISION, "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
            "num_heads": 16, "out_hidden_size": 2560, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    }, _QWEN_TOKEN_IDS),
    "qwen3-vl-moe": ConfigSpec("qwen3_vl_moe", {  # Qwen/Qwen3-VL-30B-A3B-Instruct
        "text_config": {
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        },
        "vision_config": {
            **_QWEN3_VISION, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
            "num_heads": 16, "out_hidden_size": 2048, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    }, _QWEN_TOKEN_IDS),
    # The newer checkpoints' sizes are their config classes' defaults (the published configs
    # are not at hand offline); the vision tower's patching is Qwen3-VL's.
    "qwen3.5": ConfigSpec("qwen3_5", {"vision_config": _QWEN3_VISION}, _QWEN_TOKEN_IDS),
    "qwen3.5-moe": ConfigSpec("qwen3_5_moe", {"vision_config": _QWEN3_VISION}, _QWEN_TOKEN_IDS),
    "qwen4-exp": ConfigSpec("qwen4_exp", {"vision_config": _QWEN3_VISION}, _QWEN_TOKEN_IDS),
    # vLLM builds Intern-S1-Pro on Qwen3-VL-MoE and Intern-S2-Mobius on Qwen3.5-MoE
    "intern-s1-pro": ConfigSpec(
        "qwen3_vl_moe", {"vision_config": _QWEN3_VISION}, _QWEN_TOKEN_IDS,
        hub_model_type="interns1_pro",
    ),
    "intern-s2-mobius": ConfigSpec(
        "qwen3_5_moe", {"vision_config": _QWEN3_VISION}, _QWEN_TOKEN_IDS,
        hub_model_type="interns2_mobius",
    ),
    "glm-4v": ConfigSpec("glm4v", {  # zai-org/GLM-4.1V-9B-Thinking
        "text_config": {
            "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
            "attention_bias": True, "rms_norm_eps": 1e-05, "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [8, 12, 12]},
        },
        "vision_config": {
            "depth": 24, "hidden_size": 1536, "intermediate_size": 13696, "num_heads": 12,
            "out_hidden_size": 4096, "image_size": 336, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "rms_norm_eps": 1e-05,
        },
    }, _GLM_TOKEN_IDS),
    "glm-ocr": ConfigSpec("glm_ocr", {  # zai-org/GLM-OCR (sizes: GlmOcrConfig's defaults)
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }, _GLM_TOKEN_IDS),
    "glm-5-next": ConfigSpec("glm5_next", {  # zai-org/GLM-5.3-Flash (Glm5NextConfig's defaults)
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }, _GLM_TOKEN_IDS),
    "mistral3": ConfigSpec("mistral3", {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503
        "spatial_merge_size": 2, "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu", "vision_feature_layer": -1,
        "text_config": {
            "model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120,
            "intermediate_size": 32768, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-05,
            "sliding_window": None, "rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 1000000000.0},
        },
        "vision_config": {
            "model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
            "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64,
            "image_size": 1540, "patch_size": 14,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }, {
        "image_token_index": "[IMG]",
        "text_config.bos_token_id": "<s>",
        "text_config.eos_token_id": "</s>",
    }),
    "chameleon": ConfigSpec("chameleon", {  # facebook/chameleon-7b
        "vocab_size": 65536, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05,
    }, {"image_token_id": "<image>", "bos_token_id": "<s>", "eos_token_id": "</s>"}),
    # The checkpoints' ``llama_nemotron_vl`` configs are remote code: LLaVA's config holds the
    # same fields (a Llama ``text_config``, a SigLIP ``vision_config``, the tiling entries).
    "llama-nemotron-vl-embed": ConfigSpec(
        "llava", _NEMOTRON_VALUES, _NEMOTRON_TOKEN_IDS,
        hub_model_type="llama_nemotron_vl", also_architectures=("LlamaNemotronVLModel",),
    ),
    "llama-nemotron-vl-rerank": ConfigSpec(
        "llava",
        {**_NEMOTRON_VALUES, "text_config": {**_NEMOTRON_VALUES["text_config"], "num_labels": 1}},
        _NEMOTRON_TOKEN_IDS,
        hub_model_type="llama_nemotron_vl_rerank",
    ),
    "llama4": ConfigSpec("llama4", {  # meta-llama/Llama-4-Scout-17B-16E-Instruct
        "text_config": {
            "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120,
            "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-05, "num_local_experts": 16, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1, "use_qk_norm": True, "attention_chunk_size": 8192,
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
        },
        "vision_config": {
            "model_type": "llama4_vision_model", "hidden_size": 1408, "intermediate_size": 5632,
            "num_hidden_layers": 34, "num_attention_heads": 16, "image_size": 336,
            "patch_size": 14, "pixel_shuffle_ratio": 0.5, "vision_output_dim": 4096,
            "projector_input_dim": 4096, "projector_output_dim": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }, {
        "image_token_index": "<|image|>",
        "boi_token_index": "<|image_start|>",
        "eoi_token_index": "<|image_end|>",
        "text_config.bos_token_id": "<|begin_of_text|>",
        "text_config.eos_token_id": ("<|end_of_text|>", "<|eom|>", "<|eot|>"),
        "text_config.pad_token_id": "<|finetune_right_pad|>",
    }),
    "internvl": ConfigSpec("internvl", {  # OpenGVLab/InternVL3-1B-hf
        "downsample_ratio": 0.5, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default", "image_seq_length": 256,
        "text_config": {
            "model_type": "qwen2", "vocab_size": 151674, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "vision_config": {
            "model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096,
            "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": [448, 448],
            "patch_size": [14, 14], "layer_norm_eps": 1e-06, "use_qk_norm": False,
            "attention_bias": True, "norm_type": "layer_norm", "use_mean_pooling": True,
        },
    }, {
        "image_token_id": "<IMG_CONTEXT>",
        "text_config.bos_token_id": "<|endoftext|>",
        "text_config.eos_token_id": "<|im_end|>",
    }),
    "gemma3": ConfigSpec("gemma3", {  # google/gemma-3-4b-it
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
            "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
            "sliding_window": 1024, "rms_norm_eps": 1e-06,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
            "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896,
            "patch_size": 14, "vision_use_head": False,
        },
    }, {
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
        "text_config.bos_token_id": "<bos>",
        "text_config.eos_token_id": ("<eos>", "<end_of_turn>"),
        "text_config.pad_token_id": "<pad>",
    }),
    "idefics3": ConfigSpec("idefics3", {  # HuggingFaceM4/Idefics3-8B-Llama3
        "scale_factor": 2, "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama", "vocab_size": 128259, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
        "vision_config": {
            "model_type": "idefics3_vision", "hidden_size": 1152, "intermediate_size": 4304,
            "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 364,
            "patch_size": 14,
        },
    }, {
        "image_token_id": "<image>",
        # Idefics3Config keeps a top-level pad id under this name (its default: 128002)
        "_pad_token_id": "<|reserved_special_token_0|>",
        "text_config.bos_token_id": "<|begin_of_text|>",
        "text_config.eos_token_id": ("<|end_of_text|>", "<end_of_utterance>"),
        "text_config.pad_token_id": "<|reserved_special_token_0|>",
    }),
    "llava-next": ConfigSpec("llava_next", {  # llava-hf/llava-v1.6-mistral-7b-hf
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "projector_hidden_act": "gelu", "use_image_newline_parameter": True,
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "text_config": {
            "model_type": "mistral", "vocab_size": 32064, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
            "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
            "patch_size": 14, "projection_dim": 768,
        },
    }, {
        "image_token_index": "<image>",
        "text_config.bos_token_id": "<s>",
        "text_config.eos_token_id": "</s>",
    }),
    "llava-onevision": ConfigSpec("llava_onevision", {  # llava-hf/llava-onevision-qwen2-7b-ov-hf
        "image_grid_pinpoints": [
            [h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)
        ],
        "projector_hidden_act": "gelu", "use_image_newline_parameter": True,
        "vision_aspect_ratio": "anyres_max_9", "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen2", "vocab_size": 152128, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "max_window_layers": 28, "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 384,
            "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 26,
            "patch_size": 14, "vision_use_head": False,
        },
    }, {
        "image_token_index": "<image>",
        "video_token_index": "<video>",
        "text_config.eos_token_id": "<|im_end|>",
    }),
    "smolvlm": ConfigSpec("smolvlm", {  # HuggingFaceTB/SmolVLM2-2.2B-Instruct
        "scale_factor": 3, "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama", "vocab_size": 49280, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
            "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_type": "default", "rope_theta": 273768.0},
        },
        "vision_config": {
            "model_type": "smolvlm_vision", "hidden_size": 1152, "intermediate_size": 4304,
            "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 384,
            "patch_size": 14,
        },
    }, {
        "image_token_id": "<image>",
        # SmolVLMConfig keeps a top-level pad id under this name (its default: 128002)
        "_pad_token_id": "<|im_end|>",
        "text_config.bos_token_id": "<|im_start|>",
        "text_config.eos_token_id": "<end_of_utterance>",
        "text_config.pad_token_id": "<|im_end|>",
    }),
    # deepseek-ai/DeepSeek-OCR-2: vLLM's own config class (``deepseek_vl_v2``; transformers reads
    # it through aiomm.adapters.deepseek_ocr.register_config), the language model's fields in
    # ``language_config``
    "deepseek-ocr-2": ConfigSpec("deepseek_vl_v2", {
        "candidate_resolutions": [[1024, 1024]], "global_view_pos": "head", "tile_tag": "2D",
        "language_config": {
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "vocab_size": 129280, "hidden_size": 1280, "intermediate_size": 6848,
            "moe_intermediate_size": 896, "num_hidden_layers": 12, "num_attention_heads": 10,
            "num_key_value_heads": 10, "n_routed_experts": 64, "n_shared_experts": 2,
            "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "topk_method": "greedy", "kv_lora_rank": None,
            "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
            "v_head_dim": 0, "use_mla": False, "lm_head": True, "rm_head": False,
            "torch_dtype": "bfloat16", "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        },
        "projector_config": {
            "model_type": "mlp_projector", "projector_type": "linear", "input_dim": 896,
            "n_embed": 1280,
        },
        "vision_config": {"model_type": "vision", "image_size": 1024, "patch_size": 16},
    }, {
        # not in the checkpoint's config (vLLM's model takes "<image>" from the tokenizer): for
        # the tools that read the image token from config.json (aiomm's serve stand-in)
        "image_token_id": "<image>",
        "language_config.bos_token_id": "<｜begin▁of▁sentence｜>",
        "language_config.eos_token_id": "<｜end▁of▁sentence｜>",
    }),
    # deepseek-ai/DeepSeek-OCR: DeepSeek-OCR 2's structure; its projector maps the SAM and CLIP
    # features (1024 + 1024) into the language model
    "deepseek-ocr": ConfigSpec("deepseek_vl_v2", {
        "candidate_resolutions": [[1024, 1024]], "global_view_pos": "head", "tile_tag": "2D",
        "language_config": {
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "vocab_size": 129280, "hidden_size": 1280, "intermediate_size": 6848,
            "moe_intermediate_size": 896, "num_hidden_layers": 12, "num_attention_heads": 10,
            "num_key_value_heads": 10, "n_routed_experts": 64, "n_shared_experts": 2,
            "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "topk_method": "greedy", "kv_lora_rank": None,
            "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
            "v_head_dim": 0, "use_mla": False, "lm_head": True, "rm_head": False,
            "torch_dtype": "bfloat16", "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        },
        "projector_config": {
            "model_type": "mlp_projector", "projector_type": "linear", "input_dim": 2048,
            "n_embed": 1280,
        },
        "vision_config": {
            "model_type": "vision", "model_name": "deeplip_b_l", "image_size": 1024,
            "patch_size": 16,
        },
    }, {
        "image_token_id": "<image>",  # as DeepSeek-OCR 2's (for aiomm's serve stand-in)
        "language_config.bos_token_id": "<｜begin▁of▁sentence｜>",
        "language_config.eos_token_id": "<｜end▁of▁sentence｜>",
    }),
    # moonshotai/Kimi-K2.5: images and videos as one "vision_chunk" modality in vLLM; a
    # DeepSeek-V3 (MLA) language model
    "kimi-k2.5": ConfigSpec("kimi_k25", {
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "text_config": {
            "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 7168,
            "num_hidden_layers": 61,
        },
        "vision_config": {"model_type": "kimi_k25_vision"},
    }, {
        "image_token_id": "<|media_pad|>",
        "video_token_id": "<|kimi_k25_video_placeholder|>",
        "vision_start_token_id": "<|media_begin|>",
        "vision_end_token_id": "<|media_end|>",
        "text_config.bos_token_id": "[BOS]",
        "text_config.eos_token_id": "[EOS]",
    }),
    "paddleocr-vl": ConfigSpec("paddleocr_vl", {  # PaddlePaddle/PaddleOCR-VL
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 18, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-05, "use_bias": False,
            "tie_word_embeddings": False,
            "pad_token_id": None,  # ERNIE pads with <unk>, which the folder's tokenizer lacks
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                "mrope_section": [16, 24, 24]},
        },
        "vision_config": {
            "model_type": "paddleocr_vl_vision", "hidden_size": 1152, "intermediate_size": 4304,
            "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 384,
            "patch_size": 14, "spatial_merge_size": 2, "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-06,
        },
    }, {
        "image_token_id": "<|IMAGE_PLACEHOLDER|>",
        "video_token_id": "<|VIDEO_PLACEHOLDER|>",
        "vision_start_token_id": "<|IMAGE_START|>",
        "vision_end_token_id": "<|IMAGE_END|>",
        "text_config.bos_token_id": "<s>",
        "text_config.eos_token_id": "</s>",
    }),
    "gemma4": ConfigSpec("gemma4", {  # google/gemma-4-E4B-it
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2560,
            "intermediate_size": 10240, "num_hidden_layers": 42, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512,
            "rms_norm_eps": 1e-06,
        },
        "vision_config": {
            "model_type": "gemma4_vision", "hidden_size": 768, "intermediate_size": 3072,
            "num_hidden_layers": 16, "num_attention_heads": 12, "patch_size": 16,
            "pooling_kernel_size": 3, "position_embedding_size": 10240,
            # the soft tokens per image vLLM counts without a request's max_soft_tokens
            "default_output_length": 280,
        },
        "audio_config": {"model_type": "gemma4_audio"},
    }, {
        "boi_token_id": "<|image>",
        "eoi_token_id": "<image|>",
        "image_token_id": "<|image|>",
        "video_token_id": "<|video|>",
        "boa_token_id": "<|audio>",
        "eoa_token_index": "<audio|>",
        "audio_token_id": "<|audio|>",
        "text_config.bos_token_id": "<bos>",
        "text_config.eos_token_id": ("<eos>", "<turn|>"),
        "text_config.pad_token_id": "<pad>",
    }),
    "qwen2-audio": ConfigSpec("qwen2_audio", {  # Qwen/Qwen2-Audio-7B-Instruct
        "vocab_size": 156032,
        "text_config": {
            "model_type": "qwen2", "vocab_size": 156032, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "audio_config": {
            "model_type": "qwen2_audio_encoder", "d_model": 1280, "encoder_layers": 32,
            "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_mel_bins": 128,
            "max_source_positions": 1500,
        },
    }, {
        "audio_token_index": "<|AUDIO|>",
        "text_config.bos_token_id": "<|endoftext|>",
        "text_config.eos_token_id": "<|im_end|>",
    }),
    "qwen2.5-omni": ConfigSpec("qwen2_5_omni", {  # Qwen/Qwen2.5-Omni-7B (its thinker)
        "enable_audio_output": False,
        "thinker_config": {
            "model_type": "qwen2_5_omni_thinker", "position_id_per_seconds": 25,
            "seconds_per_chunk": 2,
            "text_config": {
                "model_type": "qwen2_5_omni_text", "vocab_size": 152064, "hidden_size": 3584,
                "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                    "mrope_section": [16, 24, 24]},
            },
            "vision_config": {
                "model_type": "qwen2_5_omni_vision_encoder", "depth": 32, "hidden_size": 1280,
                "intermediate_size": 3420, "num_heads": 16, "in_channels": 3, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
                "tokens_per_second": 25,
            },
            "audio_config": {
                "model_type": "qwen2_5_omni_audio_encoder", "d_model": 1280,
                "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
                "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100,
                "output_dim": 3584,
            },
        },
    }, {
        "thinker_config.audio_token_index": "<|AUDIO|>",
        "thinker_config.image_token_index": "<|IMAGE|>",
        "thinker_config.video_token_index": "<|VIDEO|>",
        "thinker_config.audio_start_token_id": "<|audio_bos|>",
        "thinker_config.audio_end_token_id": "<|audio_eos|>",
        "thinker_config.vision_start_token_id": "<|vision_bos|>",
        "thinker_config.vision_end_token_id": "<|vision_eos|>",
        "thinker_config.text_config.bos_token_id": "<|endoftext|>",
        "thinker_config.text_config.eos_token_id": "<|im_end|>",
        "thinker_config.user_token_id": "user",
        **{f"talker_config.{key}": token for key, token in (
            ("audio_token_index", "<|AUDIO|>"), ("image_token_index", "<|IMAGE|>"),
            ("video_token_index", "<|VIDEO|>"), ("audio_start_token_id", "<|audio_bos|>"),
            ("audio_end_token_id", "<|audio_eos|>"), ("vision_start_token_id", "<|vision_bos|>"),
            ("vision_end_token_id", "<|vision_eos|>"),
        )},
    }, also_architectures=("Qwen2_5OmniModel",)),
    "qwen3-omni": ConfigSpec("qwen3_omni_moe", {  # Qwen/Qwen3-Omni-30B-A3B-Instruct (thinker)
        "enable_audio_output": False,
        "thinker_config": {
            "model_type": "qwen3_omni_moe_thinker", "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
            "text_config": {
                "model_type": "qwen3_omni_moe_text", "vocab_size": 152064, "hidden_size": 2048,
                "intermediate_size": 768, "moe_intermediate_size": 768, "num_experts": 128,
                "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-06,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                    "mrope_section": [24, 20, 20], "interleaved": True},
            },
            "vision_config": {
                "model_type": "qwen3_omni_moe_vision_encoder", "depth": 27, "hidden_size": 1152,
                "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2048,
                "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
            },
            "audio_config": {
                "model_type": "qwen3_omni_moe_audio_encoder", "d_model": 1280,
                "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
                "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 50,
                "output_dim": 2048, "n_window_infer": 800, "conv_chunksize": 500,
                "downsample_hidden_size": 480,
            },
        },
    }, {
        "thinker_config.audio_token_id": "<|audio_pad|>",
        "thinker_config.image_token_id": "<|image_pad|>",
        "thinker_config.video_token_id": "<|video_pad|>",
        "thinker_config.audio_start_token_id": "<|audio_start|>",
        "thinker_config.audio_end_token_id": "<|audio_end|>",
        "thinker_config.vision_start_token_id": "<|vision_start|>",
        "thinker_config.vision_end_token_id": "<|vision_end|>",
        "thinker_config.text_config.bos_token_id": "<|endoftext|>",
        "thinker_config.text_config.eos_token_id": "<|im_end|>",
        "thinker_config.user_token_id": "user",
        "im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>",
        "system_token_id": "system", "user_token_id": "user", "assistant_token_id": "assistant",
        **{f"talker_config.{key}": token for key, token in (
            ("audio_token_id", "<|audio_pad|>"), ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
            ("audio_start_token_id", "<|audio_start|>"),
        )},
    }),
}  # fmt: skip


def write_model_folder(name: str, path: str | Path, *, backend: str = "torchvision") -> Path:
    """Write the offline model folder of architecture or short name ``name`` into ``path``.

    :raises UnknownArchitectureError: no adapter has that name.
    :raises ConfigError: the architecture's reference processor has no family chat template or
        no config here, or its tokenizer lacks a token the config names.
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
    config = model_config(info.short_name, hf_processor)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf_processor.tokenizer.chat_template = template
    if hasattr(hf_processor, "chat_template"):
        hf_processor.chat_template = template
    save_processor(hf_processor, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    pin_tokenizer(folder, hf_processor.tokenizer)
    return folder


def model_config(name: str, hf_processor: Any) -> dict[str, Any]:
    """The ``config.json`` of architecture or short name ``name`` whose folder holds
    ``hf_processor`` (its tokenizer numbers the token ids; its ``config_entries()``, where it
    has them, are kept).

    :raises ConfigError: the architecture has no :data:`CONFIG_SPECS` entry, or the tokenizer
        lacks a token the entry names.
    """
    info = get_adapter_info(name)
    spec = CONFIG_SPECS.get(info.short_name)
    if spec is None:
        raise ConfigError(
            f"no config.json values for {info.short_name}; add them to "
            "aiomm.adapters.folders.CONFIG_SPECS"
        )
    config: dict[str, Any] = {
        "architectures": list(dict.fromkeys((info.architecture, *spec.also_architectures))),
        "model_type": spec.model_type,
        "torch_dtype": "bfloat16",
    }
    _merge(config, spec.values)
    # the context length is the language model's: in its text_config where the family nests one
    context = config.setdefault("text_config", {}) if _nests_text_config(spec) else config
    context["max_position_embeddings"] = MAX_POSITION_EMBEDDINGS
    for key, value in _token_ids(spec, hf_processor.tokenizer).items():
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    entries = getattr(hf_processor, "config_entries", None)
    if entries is not None:
        _merge(config, entries())
    return config


def _nests_text_config(spec: ConfigSpec) -> bool:
    """Whether ``spec``'s config family keeps its language model's fields in ``text_config``."""
    from transformers import CONFIG_MAPPING

    return "text_config" in (getattr(CONFIG_MAPPING[spec.model_type], "sub_configs", None) or {})


def _token_ids(spec: ConfigSpec, tokenizer: Any) -> dict[str, int | list[int]]:
    """``spec.token_ids`` as ids of ``tokenizer``.

    :raises ConfigError: the tokenizer lacks one of the tokens.
    """
    out: dict[str, int | list[int]] = {}
    for key, tokens in spec.token_ids.items():
        names = [tokens] if isinstance(tokens, str) else list(tokens)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in names]
        unknown = (None, tokenizer.unk_token_id)
        missing = [t for t, i in zip(names, ids, strict=True) if i in unknown]
        if missing:
            raise ConfigError(f"the tokenizer has no {missing} for config.json's {key}")
        out[key] = ids[0] if isinstance(tokens, str) else ids
    return out


def _merge(into: dict[str, Any], values: Mapping[str, Any]) -> None:
    """Copy ``values`` into ``into``, merging nested mappings key by key."""
    for key, value in values.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, Mapping):
            into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = list(value) if isinstance(value, tuple) else value


#: each sub-processor of an HF processor and the file a checkpoint keeps it in
_PROCESSOR_FILES = {
    "image_processor": "preprocessor_config.json",
    "video_processor": "video_preprocessor_config.json",
}


def save_processor(hf_processor: Any, folder: Path) -> None:
    """Save ``hf_processor`` into ``folder`` in the files checkpoints ship: its tokenizer and
    chat template, each sub-processor in its own file (:data:`_PROCESSOR_FILES`, with the
    ``processor_class``), and ``processor_config.json`` only for parameters of the processor's
    own. (transformers 5 nests the sub-processors in ``processor_config.json``, which both
    transformers 5 and vLLM read; vLLM picks its video loader only from
    ``video_preprocessor_config.json`` or ``preprocessor_config.json``.)"""
    hf_processor.save_pretrained(str(folder))
    composite = folder / "processor_config.json"
    if not composite.is_file():  # a reference without an HF processor (the tokenizer only)
        return
    processor = json.loads(composite.read_text())
    for attribute, filename in _PROCESSOR_FILES.items():
        sub = processor.pop(attribute, None)
        if sub is not None:
            sub["processor_class"] = processor["processor_class"]
            (folder / filename).write_text(json.dumps(sub, indent=2, sort_keys=True) + "\n")
    if set(processor) - {"processor_class"}:
        composite.write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    else:
        composite.unlink()


#: the module a folder ships where transformers would rebuild its tokenizer (:func:`pin_tokenizer`)
_TOKENIZER_MODULE = "tokenization_offline"
_TOKENIZER_CODE = '''"""The tokenizer of an aiomm offline folder, as ``tokenizer.json`` holds it."""

from transformers import TokenizersBackend


class OfflineTokenizer(TokenizersBackend):
    """``tokenizer.json`` as saved: no tokenizer of the model family rebuilt from its vocabulary."""
'''


def pin_tokenizer(folder: Path, tokenizer: Any) -> None:
    """Keep ``folder``'s tokenizer the one saved where its ``config.json`` would make transformers
    load another: for some model types (Qwen3.5, Qwen4-Exp) ``AutoTokenizer`` ignores
    ``tokenizer_class`` and rebuilds the family's byte-level BPE from the saved vocabulary, which
    drops every word of the word-level offline tokenizer. Such a folder names a tokenizer class
    of its own in ``tokenizer_config.json``'s ``auto_map``, a subclass of ``TokenizersBackend``
    that adds nothing (``tokenization_offline.py``). For exactly these model types transformers
    (5.20, which vLLM 0.33 pins, and 5.24) skips a tokenizer's remote code unless
    ``trust_remote_code`` is set and loads ``tokenizer_config.json``'s ``tokenizer_class``
    (``TokenizersBackend``: ``tokenizer.json`` as it is); with ``trust_remote_code`` the module
    loads the same tokenizer. ``tests/adapters/test_folders.py`` checks both ways."""
    from transformers import AutoTokenizer

    from aiomm.adapters.offline import PROMPT_WORDS

    probe = " ".join([*PROMPT_WORDS, *tokenizer.all_special_tokens])
    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if loaded.encode(probe) == tokenizer.encode(probe):
        return
    (folder / f"{_TOKENIZER_MODULE}.py").write_text(_TOKENIZER_CODE)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, f"{_TOKENIZER_MODULE}.OfflineTokenizer"]}
    config_file.write_text(json.dumps(config, indent=2) + "\n")


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
    folder = root / "models" / f"{info.short_name}-{__version__}-f{FOLDER_FORMAT}"
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
