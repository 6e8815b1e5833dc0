"""SmolVLM (``SmolVLMForConditionalGeneration``), images.

Reference: transformers' ``SmolVLMProcessor`` with ``SmolVLMImageProcessor`` (torchvision
backend) or ``SmolVLMImageProcessorPil`` (PIL backend), as ``HuggingFaceTB/SmolVLM2-2.2B-Instruct``
configures them: the longest edge resized to 1536 (4 x 384), sub-images of 384 px, Lanczos,
mean/std 0.5, 81 ``<image>`` tokens per sub-image (SigLIP patch 14 on 384 px, pixel shuffle 3).

transformers generates SmolVLM's image processors from Idefics3's, and vLLM 0.33's
``SmolVLMMultiModalProcessor`` is its ``Idefics3MultiModalProcessor``, so the transform, the
prompt expansion and the items are Idefics3's (:mod:`aiomm.adapters.idefics3`). What differs is the
processor: it names the global image's tag ``global_image_token`` and holds a video processor,
which vLLM never calls (its SmolVLM takes images only; a request with a video is refused, as vLLM
refuses it).
"""

from __future__ import annotations

from typing import Any, ClassVar

from aiomm.adapters.idefics3 import (
    END_OF_UTTERANCE,
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_TOKEN,
    ROW_COL_TOKENS,
    Idefics3MultiModalProcessor,
)
from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register

__all__ = ("SmolVLMMultiModalProcessor",)

#: SmolVLM2's chat tokens (SmolLM2's) and its image tokens
SMOLVLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    FAKE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_TOKEN, *ROW_COL_TOKENS,
)  # fmt: skip

# HuggingFaceTB/SmolVLM2-2.2B-Instruct's preprocessor_config.json and processor_config.json
SMOLVLM_IMAGE_PARAMS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_pad": True,
    "do_resize": True,
    "size": {"longest_edge": 1536},
    "max_image_size": {"longest_edge": 384},
    "resample": 1,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
#: the video processor reads the same file; its frames are single 384-px sub-images
SMOLVLM_VIDEO_PARAMS: dict[str, Any] = {
    **SMOLVLM_IMAGE_PARAMS,
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 384}},
}
SMOLVLM_PROCESSOR_PARAMS: dict[str, Any] = {"image_seq_len": 81}


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``SmolVLMProcessor`` of SmolVLM2-2.2B-Instruct, with a tokenizer built in code
    (transformers' processor needs the ``num2words`` package).

    :raises ValueError: an unknown backend.
    """
    import transformers

    classes = {
        "torchvision": transformers.SmolVLMImageProcessor,
        "pil": transformers.SmolVLMImageProcessorPil,
    }
    if backend not in classes:
        raise ValueError(f"unknown backend {backend!r}")
    tokenizer = build_tokenizer(SMOLVLM_SPECIAL_TOKENS, eos_token=END_OF_UTTERANCE)
    tokenizer.bos_token = "<|im_start|>"
    tokenizer.pad_token = "<|im_end|>"
    return transformers.SmolVLMProcessor(
        image_processor=classes[backend](**{**SMOLVLM_IMAGE_PARAMS, **overrides}),
        tokenizer=tokenizer,
        video_processor=transformers.SmolVLMVideoProcessor(**SMOLVLM_VIDEO_PARAMS),
        **SMOLVLM_PROCESSOR_PARAMS,
    )


@register(
    Architecture(
        "smolvlm", "SmolVLMForConditionalGeneration", build_hf_processor,
        "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
    )
)  # fmt: skip
class SmolVLMMultiModalProcessor(Idefics3MultiModalProcessor):
    """Processor of SmolVLM (``SmolVLMProcessor``): Idefics3's, images only."""

    global_token_attribute: ClassVar[str] = "global_image_token"
