"""The fields of vLLM 0.33's Responses and Anthropic request models.

A body is read through its API's request model, and pydantic ignores a field the model does not
have: ``n`` in a Responses body or ``seed`` in an Anthropic one changes nothing in vLLM's
answer. :func:`own_fields` keeps only a body's own fields, so that aiomm reads what vLLM reads.
Chat and completion bodies lose only the few fields aiomm would otherwise act on that their
models lack (their models are the widest, and nothing else they lack is read).
"""

from __future__ import annotations

from typing import Any

__all__ = ("own_fields",)

_FIELDS: dict[str, frozenset[str]] = {
    "responses": frozenset(
        "background cache_salt chat_template_kwargs ec_transfer_params enable_response_messages "
        "frequency_penalty ignore_eos include include_reasoning include_stop_str_in_output "
        "input instructions kv_transfer_params logit_bias max_output_tokens max_tool_calls "
        "media_io_kwargs metadata min_p mm_payload mm_processor_kwargs model "
        "parallel_tool_calls presence_penalty previous_input_messages previous_response_id "
        "priority prompt prompt_cache_key prompt_cache_options prompt_cache_retention reasoning "
        "repetition_penalty request_id return_mm_kwargs safety_identifier seed service_tier "
        "session_id skip_special_tokens spaces_between_special_tokens stop stop_token_ids store "
        "stream structured_outputs temperature text tool_choice tools top_k top_logprobs top_p "
        "truncation user vllm_xargs watermarking".split()
    ),
    "messages": frozenset(
        "cache_salt chat_template_kwargs ec_transfer_params kv_transfer_params max_tokens "
        "messages metadata mm_payload model output_config return_mm_kwargs stop_sequences "
        "stream system temperature thinking tool_choice tools top_k top_p vllm_xargs "
        "watermarking".split()
    ),
}


#: fields of other APIs' models that vLLM 0.33's chat or completion model lacks, and that aiomm
#: would otherwise refuse or read
_LACKS: dict[str, frozenset[str]] = {
    "chat": frozenset({"suffix", "prompt_embeds", "output_config"}),
    "completion": frozenset(
        {"tools", "chat_template", "mm_processor_kwargs", "output_config", "top_logprobs"}
    ),
}


def own_fields(body: dict[str, Any], api: str) -> dict[str, Any]:
    """``body`` without the fields ``api``'s request model does not have (``api``:
    ``"chat"``, ``"completion"``, ``"responses"`` or ``"messages"``)."""
    fields = _FIELDS.get(api)
    if fields is not None:
        return {k: v for k, v in body.items() if k in fields}
    lacks = _LACKS.get(api, frozenset())
    if lacks.isdisjoint(body):  # the usual body: no copy
        return body
    return {k: v for k, v in body.items() if k not in lacks}
