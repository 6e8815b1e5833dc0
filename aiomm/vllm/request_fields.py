"""The fields of vLLM 0.33's Responses, Anthropic and chat-form tokenize request models.

A body is read through its API's request model, and pydantic ignores a field the model does not
have: ``n`` in a Responses body or ``seed`` in an Anthropic one changes nothing in vLLM's
answer. :func:`own_fields` keeps only a body's own fields, so that aiomm reads what vLLM reads.
Chat and completion bodies lose only the few fields aiomm would otherwise act on that their
models lack (their models are the widest, and nothing else they lack is read).
:func:`refuse_nulls` refuses a ``null`` for the fields whose type in vLLM's model has no None.
"""

from __future__ import annotations

from typing import Any

from aiomm.vllm.errors import ApiError

__all__ = ("own_fields", "refuse_nulls")

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
    # the chat form of /tokenize (vLLM's ``TokenizeChatRequest``), rendered as a chat request
    "tokenize": frozenset(
        "add_generation_prompt add_special_tokens chat_template chat_template_kwargs "
        "continue_final_message media_io_kwargs messages mm_processor_kwargs model "
        "return_token_strs tools".split()
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
    ``"chat"``, ``"completion"``, ``"responses"``, ``"messages"`` or ``"tokenize"``)."""
    fields = _FIELDS.get(api)
    if fields is not None:
        return {k: v for k, v in body.items() if k in fields}
    lacks = _LACKS.get(api, frozenset())
    if lacks.isdisjoint(body):  # the usual body: no copy
        return body
    return {k: v for k, v in body.items() if k not in lacks}


_BOOL, _INT, _LIST = "a valid boolean", "a valid integer", "a valid list"
_COMMON_NOT_NULL = {
    "ignore_eos": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "priority": _INT,
    "request_id": "a valid string",
    "mm_payload": "'tensors' or 'none'",
}
_SAMPLING_NOT_NULL = {
    **_COMMON_NOT_NULL,
    "add_special_tokens": _BOOL,
    "bad_words": _LIST,
    "length_penalty": "a valid number",
    "min_tokens": _INT,
    "return_weight_versions": _BOOL,
    "routed_experts_prompt_start": _INT,
    "use_beam_search": _BOOL,
}
#: the optional fields of vLLM 0.33's request models whose type has no None (pydantic answers
#: a null with "Input should be ..."); the words after "Input should be"
_NOT_NULL: dict[str, dict[str, str]] = {
    "chat": {
        **_SAMPLING_NOT_NULL,
        "add_generation_prompt": _BOOL,
        "continue_final_message": _BOOL,
        "echo": _BOOL,
        "include_reasoning": _BOOL,
    },
    "completion": {**_SAMPLING_NOT_NULL, "n": _INT},
    "responses": {
        **_COMMON_NOT_NULL,
        "enable_response_messages": _BOOL,
        "include_reasoning": _BOOL,
        "service_tier": "'auto', 'default', 'flex', 'scale' or 'priority'",
        "tool_choice": "a valid dictionary or object to extract fields from",
        "tools": _LIST,
    },
    "messages": {"mm_payload": "'tensors' or 'none'"},
}


def refuse_nulls(body: dict[str, Any], api: str) -> None:
    """Refuse a ``null`` where ``api``'s vLLM request model takes none, as vLLM does.

    :raises ApiError: 400 naming the first such field.
    """
    not_null = _NOT_NULL.get(api, {})
    for key, value in body.items():
        if value is None and key in not_null:
            raise ApiError(f"{key}: Input should be {not_null[key]}", param=key)
