"""Qwen-VL family cases beyond the parity harness: the Intern-S rows are Qwen3-VL's processor
with the checkpoints' vision geometry."""

from __future__ import annotations

from parity import hf_processor

from aiomm.adapters import get_adapter_info
from aiomm.adapters.qwen_vl import QWEN3, QwenVLProcessor


def test_intern_s_rows_are_qwen3_vl_with_the_checkpoint_geometry() -> None:
    """The checkpoints' vision towers: patch 16, temporal patch 2, 2x2 merge (factor 32)."""
    for name in ("intern-s1-pro", "intern-s2-mobius"):
        info = get_adapter_info(name)
        assert info.processor_cls is QwenVLProcessor and info.build_hf_processor is QWEN3
        ip = hf_processor(name, "torchvision").image_processor
        assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (16, 2, 2), name
        proc = hf_processor(name, "pil")
        assert type(proc).__name__ == "Qwen3VLProcessor"
        assert proc.image_token_id == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
