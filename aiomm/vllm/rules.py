"""vLLM 0.33's rules for a render request's fields that the render service applies around the
engine: what it refuses rather than answers differently (:data:`UNREPRODUCED`), how it cuts a
prompt (``truncate_prompt_tokens``, before and after the placeholders are expanded), the request
id it composes and the parse context's tool settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiomm.engine._ids import random_hex
from aiomm.vllm.errors import ApiError
from aiomm.vllm.request_values import lax_bool, lax_int

__all__ = (
    "ID_PREFIX",
    "TEMPLATE_FLAGS",
    "TEMPLATE_KWARGS_REFUSED",
    "TOOL_CHOICE",
    "completion_prompts",
    "parallel_tool_calls",
    "refuse_unreproduced",
    "request_id_of",
    "template_extras",
    "tool_choice_of",
    "truncated",
    "truncated_expanded",
)


#: ``chat_template_kwargs`` keys vLLM refuses
TEMPLATE_KWARGS_REFUSED = frozenset({"chat_template", "tokenize"})


#: per API: the parse context's default ``tool_choice`` ("" for null; None: no parse context)
TOOL_CHOICE: dict[str, str | None] = {"chat": "none", "messages": "", "responses": None}


#: per API: the prefix of a request id (a Responses body's own id is taken as it is)
ID_PREFIX = {"chat": "chatcmpl-", "messages": "chatcmpl-", "completion": "cmpl-", "responses": ""}


#: chat-template kwargs the request's own fields set
TEMPLATE_FLAGS = frozenset({"add_generation_prompt", "continue_final_message"})


#: request fields that change vLLM's rendering in ways aiomm does not reproduce, with the value
#: that leaves them out, and why
_UNREPRODUCED: dict[str, tuple[Any, str]] = {
    "tools": (None, "tool definitions are not rendered into the prompt"),
    "chat_template": (
        None,
        "a request's own chat template is refused (as vLLM refuses it "
        "without --trust-request-chat-template)",
    ),
    "mm_processor_kwargs": (
        {},  # vLLM refuses only a non-empty one
        "per-request processor kwargs are refused (as vLLM refuses them by default)",
    ),
    "use_beam_search": (False, "Beam search is not supported by the render endpoint"),
    "structured_outputs": (None, "structured outputs are not rendered"),
    "logprob_token_ids": (None, "logprob_token_ids are not rendered"),
    "suffix": (None, "fill-in-the-middle completions are not rendered"),
    "prompt_embeds": (None, "prompt embeddings are not taken"),
    "watermarking": (None, "watermarking is not rendered"),
    "repetition_detection": (None, "repetition detection is not rendered"),
    "routed_experts_prompt_start": (0, "routed_experts_prompt_start is not rendered"),
    "return_token_offsets": (False, "token offsets are not rendered"),
    "output_config": ({}, "output_config is not rendered"),  # an empty one changes nothing
}


_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})


def refuse_unreproduced(body: Mapping[str, Any], api: str = "chat") -> None:
    """Refuse a request to ``api`` that sets a field whose effect on vLLM's response aiomm does
    not reproduce, or that vLLM refuses: a 400 naming it, never a response that silently
    differs from vLLM's.

    :raises ApiError: 400 naming the field.
    """
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):  # checked with or without a cut
        raise ApiError("'truncation_side' must be 'left' or 'right'", param="truncation_side")
    for key, (unset, why) in _UNREPRODUCED.items():
        value = body.get(key)
        if value is not None and value != unset and value != []:
            raise ApiError(f"'{key}' is not supported: {why}", param=key)
    if api == "messages":
        if body.get("max_tokens") is None:
            raise ApiError("'max_tokens' is required", param="max_tokens")
        thinking = body.get("thinking")
        if thinking is not None and not (
            isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        ):  # "disabled" sets a reasoning effort vLLM probes the template for
            raise ApiError(
                "'thinking' is not supported unless enabled or adaptive", param="thinking"
            )
    choice = body.get("tool_choice") if api in ("chat", "messages") else None
    if choice is not None and choice != "none" and not _anthropic_choice_none(choice):
        raise ApiError(  # vLLM's words: tools themselves are refused above
            "When using `tool_choice`, `tools` must be set.", param="tool_choice"
        )
    text = body.get("text") if api == "responses" else None
    text_format = text.get("format") if isinstance(text, dict) else None
    if text is not None and (
        not isinstance(text, dict)
        or (
            text_format is not None
            and (not isinstance(text_format, dict) or text_format.get("type") != "text")
        )
    ):
        raise ApiError(
            "'text.format' other than text is not supported: structured outputs are not rendered",
            param="text",
        )
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise ApiError(
            "'response_format' other than text is not supported: structured outputs are not "
            "rendered",
            param="response_format",
        )


def truncated(ids: list[int], body: Mapping[str, Any], max_model_len: int) -> list[int]:
    """``ids`` cut to the request's ``truncate_prompt_tokens`` as vLLM cuts a prompt: its last
    tokens kept (``truncation_side: "right"``: its first), ``-1`` the most the context takes
    with room for one output token.

    :raises ApiError: a size above the context, or a cut that leaves no token.
    """
    cut = _truncation(len(ids), body, max_model_len)
    return ids if cut is None else ids[cut]


def truncated_expanded(
    ids: list[int], features: dict[str, Any], body: Mapping[str, Any], max_model_len: int
) -> list[int]:
    """``ids`` with their placeholders expanded, cut again to ``truncate_prompt_tokens`` as vLLM's
    ``_truncate_expanded_prompt`` cuts them: every placeholder range must survive whole, and
    ``features``' ranges are moved (in place) with a cut from the left.

    :raises ApiError: a cut that would split or drop an item.
    """
    cut = _truncation(len(ids), body, max_model_len)
    if cut is None:
        return ids
    start, stop, _ = cut.indices(len(ids))
    placeholders = features["mm_placeholders"]
    for modality, ranges in placeholders.items():
        for r in ranges:
            end = r["offset"] + r["length"]
            if r["offset"] < start or end > stop:
                raise ApiError(
                    f"truncate_prompt_tokens={body['truncate_prompt_tokens']} would split or drop "
                    f"a(n) {modality} item, which spans tokens {r['offset']} to {end} of the "
                    f"{len(ids)}-token prompt. Multimodal placeholders expand after truncation "
                    "is applied, so the limit must leave every multimodal item intact. Please "
                    "raise truncate_prompt_tokens or shorten the multimodal input.",
                    param="truncate_prompt_tokens",
                )  # vLLM's words
    for ranges in placeholders.values():
        for r in ranges:
            r["offset"] -= start
    return ids[cut]


def _truncation(length: int, body: Mapping[str, Any], max_model_len: int) -> slice | None:
    """The slice ``truncate_prompt_tokens`` keeps of ``length`` tokens; None: all of them."""
    limit = body.get("truncate_prompt_tokens")
    if limit is None:
        return None
    limit = lax_int(limit, "truncate_prompt_tokens", lo=-1)
    if limit > max_model_len:
        raise ApiError(
            f"truncate_prompt_tokens={limit} cannot be greater than max_model_len={max_model_len}",
            param="truncate_prompt_tokens",
        )
    if limit == -1:
        limit = max_model_len - 1
    if limit == 0:
        raise ApiError("No token_ids rendered", param="truncate_prompt_tokens")  # vLLM's words
    if length <= limit:
        return None
    return slice(-limit, None) if body.get("truncation_side") != "right" else slice(0, limit)


def template_extras(body: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """What vLLM adds to a request's chat-template kwargs: ``documents``, ``reasoning_effort``
    and, with an effort, ``enable_thinking`` unless the request set it."""
    extras: dict[str, Any] = {}
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list):
            raise ApiError("'documents' must be a list", param="documents")
        extras["documents"] = documents
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _REASONING_EFFORTS:
            raise ApiError(
                f"'reasoning_effort' must be one of {sorted(_REASONING_EFFORTS)}",
                param="reasoning_effort",
            )
        extras["reasoning_effort"] = effort
        if "enable_thinking" not in user:
            extras["enable_thinking"] = effort != "none"
    return extras


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A completion request's prompts: a string, token ids, or a list of either.

    :raises ApiError: any other shape, an empty one, or a token id below 0.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' must be non-empty", param="prompt")
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("'prompt' must be a string, a list of strings or token ids", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [[lax_int(t, "prompt", lo=0) for t in p] for p in prompt]
    return [[lax_int(t, "prompt", lo=0) for t in prompt]]


def request_id_of(body: Mapping[str, Any], api: str, header_id: str | None = None) -> str:
    """vLLM's request id: the API's prefix and the client's id (an ``X-Request-Id`` header, else
    the body's ``request_id``, even an empty one), else a random one. Responses take the
    body's id as it is, and no header."""
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise ApiError("'request_id' must be a string", param="request_id")
    if header_id is not None and api != "responses":
        rid = header_id
    if rid is None:
        return f"{ID_PREFIX[api] or 'resp_'}{random_hex(8)}"
    return ID_PREFIX[api] + rid


def tool_choice_of(body: Mapping[str, Any], default: str, api: str) -> str | None:
    if api == "messages":  # vLLM's Anthropic mapping of the one choice it takes untooled
        return "none" if _anthropic_choice_none(body.get("tool_choice")) else None
    if "tool_choice" in body and body["tool_choice"] is None:
        return None  # an explicit null stays null
    return default or None


def _anthropic_choice_none(choice: Any) -> bool:
    return isinstance(choice, dict) and choice.get("type") == "none"


def parallel_tool_calls(body: Mapping[str, Any], api: str) -> bool | None:
    if api == "messages" and isinstance(choice := body.get("tool_choice"), dict):
        # vLLM's Anthropic mapping: a tool choice carries whether calls may run in parallel
        return not lax_bool(
            choice.get("disable_parallel_tool_use") or False, "disable_parallel_tool_use"
        )
    if api != "chat" or "parallel_tool_calls" not in body:
        return True
    value = body["parallel_tool_calls"]
    return None if value is None else lax_bool(value, "parallel_tool_calls")
