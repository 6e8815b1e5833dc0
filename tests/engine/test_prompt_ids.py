"""The assemble stage's prompt tokenization: HF's fast tokenizer called through its backend gives
the wrapper's ids, and falls back to the wrapper when the backend's state would differ."""

from __future__ import annotations

import pytest

from aiomm.adapters import build_processor, supported_adapters
from aiomm.engine.stages.assemble import AssembleStage
from aiomm.processing.tokenize import LONG_TEXT_CHARS, encode_plain, plain_backend
from aiomm.types import Request

PROMPTS = [
    "Describe <|vision_start|><|image_pad|><|vision_end|> in one line.",
    "héllo  wörld\n\n<|im_start|>user\ttabs",
    "",
    "<|image_pad|>" * 3 + " trailing",
    # long text: encoded through encode_batch (the GIL released), the same ids
    "héllo <|image_pad|> wörld\n" * 800,
]


def test_the_long_prompt_is_long() -> None:
    assert len(PROMPTS[-1]) > LONG_TEXT_CHARS


@pytest.mark.parametrize("name", [info.short_name for info in supported_adapters()])
def test_backend_ids_equal_the_wrappers(make_processor, name: str) -> None:
    stage = AssembleStage(make_processor(name))
    tokenizer = stage.processor.hf_processor.tokenizer
    assert plain_backend(tokenizer) is not None  # every reference tokenizer is a fast one
    for prompt in PROMPTS:
        expected = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert stage.prompt_ids(Request(prompt=prompt)) == list(expected)


@pytest.mark.parametrize("name", [info.short_name for info in supported_adapters()])
def test_encode_plain_equals_the_wrappers_encode(make_processor, name: str) -> None:
    # the server's chat renderer tokenizes the rendered template with it
    tokenizer = make_processor(name).hf_processor.tokenizer
    for prompt in PROMPTS:
        assert encode_plain(tokenizer, prompt) == tokenizer.encode(prompt, add_special_tokens=False)


def test_backend_state_the_wrapper_would_reset_falls_back(make_processor) -> None:
    tokenizer = make_processor("qwen2-vl").hf_processor.tokenizer
    backend = tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=2)
    try:
        assert plain_backend(tokenizer) is None  # the wrapper switches truncation off first
        stage = AssembleStage(make_processor("qwen2-vl"))
        assert len(stage.prompt_ids(Request(prompt=PROMPTS[1]))) > 2
    finally:
        backend.no_truncation()
    assert plain_backend(tokenizer) is backend


def test_a_stored_tokenizer_is_not_made_to_build_the_real_one() -> None:
    processor = build_processor("qwen2-vl")  # the stored snapshot
    tokenizer = processor.hf_processor.tokenizer
    # asked of its class only (tests/adapters/test_stored.py: nothing imports transformers)
    assert plain_backend(tokenizer) is None
    ids = AssembleStage(processor).prompt_ids(Request(prompt=PROMPTS[0]))
    assert ids == tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
