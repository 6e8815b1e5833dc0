"""The Intern-S family: Intern-S1-Pro and Intern-S2-Mobius (images).

Reference, as vLLM serves them (``vllm/model_executor/models/interns1_pro.py`` and
``interns2_mobius.py`` -> ``interns2_preview.py`` in vllm-project/vllm): both architectures are
registered with ``Qwen3VLMultiModalProcessor`` and ``Qwen3VLDummyInputsBuilder``, i.e. the
checkpoint's HF processor is a Qwen3-VL processor (``Qwen3VLProcessor`` over
``Qwen2VLImageProcessor``), not InternVL's tiling. sglang agrees for Intern-S2-Mobius (it lists
the architecture among its Qwen-VL processor's models). The checkpoints' configs fit that
processor: a Qwen3-VL vision tower with ``patch_size`` 16 and ``temporal_patch_size`` 2, and
``image_token_id`` equal to the Qwen vocabulary's ``<|image_pad|>`` (151655 for Intern-S1-Pro,
248056 for Intern-S2-Mobius, the Qwen3.5 vocabulary).

So the transform, the fields, the uint8 path and the prompt update are Qwen-VL's
(:class:`~aiomm.adapters.qwen_vl.QwenVLProcessor`): ``smart_resize`` to a multiple of 32, bicubic
resize, patch rows, and ``<|image_pad|>`` expanded to ``grid_t * grid_h * grid_w / 4`` tokens.
The offline reference is transformers' ``Qwen3VLProcessor`` built with the Qwen3-VL preprocessor
parameters (patch 16, merge 2, mean/std 0.5, 65536..16777216 pixels); a checkpoint's own
``preprocessor_config.json`` overrides them through :func:`~aiomm.adapters.from_pretrained`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.qwen_vl import QwenVLProcessor
from aiomm.adapters.registry import AdapterInfo, register

__all__ = ("INTERN_S_IMAGE_PARAMS", "InternSProcessor")

INTERN_S_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip

#: Qwen3-VL's published preprocessor parameters, which the Qwen3-VL vision tower takes.
INTERN_S_IMAGE_PARAMS: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


class InternSProcessor(QwenVLProcessor):
    """Processor of Intern-S1-Pro and Intern-S2-Mobius: Qwen3-VL's, unchanged."""

    default_device_normalize: ClassVar[bool] = True


def build_intern_s_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """The reference HF processor, offline: ``Qwen3VLProcessor`` with a tokenizer built in code."""
    import transformers

    image_cls = {
        "torchvision": transformers.Qwen2VLImageProcessor,
        "pil": transformers.Qwen2VLImageProcessorPil,
    }[backend]
    params = {**INTERN_S_IMAGE_PARAMS, **overrides}
    video_params = {k: v for k, v in params.items() if k != "size"}
    return transformers.Qwen3VLProcessor(
        image_processor=image_cls(**params),
        tokenizer=build_tokenizer(INTERN_S_SPECIAL_TOKENS, eos_token="<|endoftext|>"),
        video_processor=transformers.Qwen3VLVideoProcessor(**video_params),
    )


for _short, _arch, _example in (
    ("intern-s1-pro", "InternS1ProForConditionalGeneration", "internlm/Intern-S1-Pro"),
    ("intern-s2-mobius", "InternS2MobiusForConditionalGeneration", "internlm/Intern-S2-Mobius"),
):
    register(
        AdapterInfo(
            short_name=_short,
            architecture=_arch,
            processor_cls=InternSProcessor,
            build_hf_processor=build_intern_s_hf_processor,
            example_models=_example,
        )
    )
