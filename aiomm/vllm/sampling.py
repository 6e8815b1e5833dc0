"""``sampling_params`` as vLLM 0.33 derives them for a render response.

Defaults come from the model folder's ``generation_config.json`` (temperature, top_p, top_k,
penalties, ``max_new_tokens``, ``skip_special_tokens``), overridden by the request.
``max_tokens`` defaults to the model's context length minus the prompt (16 for completions,
whose request model has that default); vLLM's serialiser omits it when it equals 16.
Stop strings set ``output_text_buffer_length`` to the longest one's length minus one. A
``max_tokens`` above the model's context is refused, one above what the prompt leaves lowered to
it (vLLM's ``get_max_tokens``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from aiomm.vllm.errors import ApiError
from aiomm.vllm.request_fields import own_fields
from aiomm.vllm.request_values import flag, lax_float, lax_int

__all__ = ("SamplingDefaults", "derive")

#: vLLM's ``get_diff_sampling_param`` keys (``max_new_tokens`` becomes ``max_tokens``)
_FROM_GENERATION_CONFIG = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
    "skip_special_tokens",
)
_VLLM_DEFAULT_MAX_TOKENS = 16


class SamplingDefaults:
    """The model's generation defaults and context length."""

    def __init__(self, values: dict[str, Any], max_model_len: int) -> None:
        self.values = values
        self.max_model_len = max_model_len

    @classmethod
    def from_folder(cls, folder: Path) -> SamplingDefaults:
        """Read ``generation_config.json`` and the context length of ``config.json``."""
        gen: dict[str, Any] = {}
        path = folder / "generation_config.json"
        if path.is_file():
            gen = json.loads(path.read_text())
        config: dict[str, Any] = {}
        if (folder / "config.json").is_file():
            config = json.loads((folder / "config.json").read_text())
        text = config.get("text_config") or config
        max_len = int(
            text.get("max_position_embeddings") or config.get("max_position_embeddings") or 32768
        )
        values = {k: gen[k] for k in _FROM_GENERATION_CONFIG if gen.get(k) is not None}
        if "max_new_tokens" in values:
            values["max_tokens"] = values.pop("max_new_tokens")
        return cls(values, max_len)


def _float(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, *, open_lo: bool = False
) -> float:
    """``body[key]`` (``default`` when absent) in ``[lo, hi]``, or ``(lo, hi]`` with
    ``open_lo``."""
    value = body.get(key)
    number = float(default if value is None else lax_float(value, key))
    if not (lo < number if open_lo else lo <= number) or number > hi:
        shown = f"{'(' if open_lo else '['}{lo:g}, {hi:g}]"
        raise ApiError(f"{key} must be in {shown}, got {number}", param=key)
    return number


#: what each API calls its output budget, and the budget it has when the request names none
#: (None: what the context leaves after the prompt)
_MAX_TOKENS: dict[str, tuple[tuple[str, ...], int | None]] = {
    "chat": (("max_completion_tokens", "max_tokens"), None),
    "messages": (("max_tokens",), None),
    "completion": (("max_tokens",), _VLLM_DEFAULT_MAX_TOKENS),
    "responses": (("max_output_tokens",), None),
}
#: vLLM raises a positive temperature below this to it; below ``_GREEDY_BELOW`` it samples greedily
_MIN_TEMPERATURE = 1e-2
#: vLLM's VLLM_MAX_STOP_STRINGS default: a longer ``stop`` list is refused
_MAX_STOP_STRINGS = 4
#: vLLM's VLLM_MAX_N_SEQUENCES default
_MAX_N = 16384
_GREEDY_BELOW = 1e-5
#: flags a request may set, the value that leaves them out of ``sampling_params``
_FLAGS = (
    ("ignore_eos", False),
    ("skip_special_tokens", True),
    ("spaces_between_special_tokens", True),
    ("include_stop_str_in_output", False),
)


def derive(
    body: dict[str, Any], defaults: SamplingDefaults, prompt_len: int, *, api: str = "chat"
) -> dict[str, Any]:
    """The ``sampling_params`` object of a render response for a request to ``api``
    (``"chat"``, ``"messages"``, ``"completion"`` or ``"responses"``), validated as vLLM
    validates them (types as :mod:`.request_values` reads them, vLLM's ranges); a
    ``max_tokens`` above what the context leaves after the prompt is lowered to it, as vLLM
    does. Keys appear in vLLM's order, and only where vLLM writes them.

    :raises ApiError: a parameter of the wrong type or out of range, or a prompt longer than
        the context.
    """
    if prompt_len >= defaults.max_model_len:
        raise ApiError(
            f"the prompt has {prompt_len} tokens, the model's context is {defaults.max_model_len}"
        )
    d = defaults.values
    body = own_fields(body, api)
    stream = flag(body, "stream", False)
    out: dict[str, Any] = {}
    n = _int(body, "n", 1)
    if not 1 <= n <= _MAX_N:
        raise ApiError(f"n must be from 1 to {_MAX_N}, got {n}", param="n")
    if n != 1:
        out["n"] = n
    out["presence_penalty"] = _float(
        body, "presence_penalty", d.get("presence_penalty", 0.0), -2.0, 2.0
    )
    out["frequency_penalty"] = _float(
        body, "frequency_penalty", d.get("frequency_penalty", 0.0), -2.0, 2.0
    )
    out["repetition_penalty"] = _float(
        body, "repetition_penalty", d.get("repetition_penalty", 1.0), 0.0, math.inf, open_lo=True
    )
    temperature = _float(body, "temperature", d.get("temperature", 1.0), 0.0, 2.0)
    top_p = _float(body, "top_p", d.get("top_p", 1.0), 0.0, 1.0, open_lo=True)
    top_k = body.get("top_k")
    top_k = int(d.get("top_k", 0)) if top_k is None else lax_int(top_k, "top_k", lo=-1)
    min_p = _float(body, "min_p", d.get("min_p", 0.0), 0.0, 1.0)
    # raised before the greedy test, as vLLM's __post_init__ does: 1e-6 samples at 0.01
    if 0 < temperature < _MIN_TEMPERATURE:
        temperature = _MIN_TEMPERATURE
    greedy = temperature < _GREEDY_BELOW
    if greedy:  # vLLM resets what only sampling reads
        if n != 1:
            raise ApiError(f"n must be 1 when using greedy sampling, got {n}", param="n")
        top_p, top_k, min_p = 1.0, 0, 0.0
    out["temperature"] = temperature
    if not greedy:  # vLLM's serialiser leaves out the values its greedy reset writes
        out["top_p"] = top_p
    if top_k != 0:  # vLLM leaves out a top_k of 0 (seen with no generation_config.json)
        out["top_k"] = top_k
    if not greedy:
        out["min_p"] = min_p
    seed = None if body.get("seed") is None else lax_int(body["seed"], "seed")
    if seed is not None and seed != -1:  # vLLM: -1 is no seed
        out["seed"] = seed
    stop_key = "stop_sequences" if api == "messages" else "stop"
    stop = body.get(stop_key)
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(f"'{stop_key}' must be a string or a list of strings", param=stop_key)
    if len(stop) > _MAX_STOP_STRINGS:
        raise ApiError(
            f"List should have at most {_MAX_STOP_STRINGS} items after validation, not {len(stop)}",
            param=stop_key,
        )  # pydantic's words, as vLLM answers
    if not all(stop):
        raise ApiError("stop cannot contain an empty string", param=stop_key)
    out["stop"] = stop
    out["stop_token_ids"] = list(dict.fromkeys(_ints(body, "stop_token_ids") or []))
    if flag(body, "ignore_eos", False):
        out["ignore_eos"] = True
    keys, budget = _MAX_TOKENS[api]
    room = defaults.max_model_len - prompt_len
    asked_key = next((k for k in keys if body.get(k) is not None), None)
    if asked_key is None:
        asked = budget if budget is not None else d.get("max_tokens")
        max_tokens = room if asked is None else min(int(asked), room)
    else:
        asked = lax_int(body[asked_key], asked_key)
        if asked > defaults.max_model_len:
            raise ApiError(
                f"{asked_key}={asked} cannot be greater than "
                f"max_model_len={defaults.max_model_len}",
                param=asked_key,
            )
        if api == "completion" and asked == 0 and flag(body, "echo", False):
            asked = 1  # vLLM: an echo without generation still runs one step
        if asked < 1:
            raise ApiError(f"{asked_key} must be at least 1, got {asked}", param=asked_key)
        max_tokens = min(asked, room)
    if max_tokens != _VLLM_DEFAULT_MAX_TOKENS:
        out["max_tokens"] = max_tokens
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be at least 0, got {min_tokens}", param="min_tokens")
    if min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens must be at most max_tokens={max_tokens}, got {min_tokens}",
            param="min_tokens",
        )
    if min_tokens:
        out["min_tokens"] = min_tokens
    logprobs, prompt_logprobs = _logprobs(body, api, stream)
    if logprobs is not None and logprobs < -1:
        key = "logprobs" if api == "completion" else "top_logprobs"
        raise ApiError(f"logprobs must be non-negative or -1, got {logprobs}", param=key)
    if logprobs is not None:
        out["logprobs"] = logprobs
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    skip_special = d.get("skip_special_tokens", True)
    for key, default in _FLAGS:
        value = flag(body, key, skip_special if key == "skip_special_tokens" else default)
        if value != default:
            out[key] = value
    out["output_kind"] = 1 if stream else 2  # DELTA or FINAL_ONLY
    if body.get("stream_interval") is not None:
        out["stream_interval"] = lax_int(body["stream_interval"], "stream_interval", lo=1)
    out["skip_clone"] = True
    buffer = max((len(s) for s in stop), default=1) - 1
    if buffer > 0 and not out.get("include_stop_str_in_output"):  # held back to be cut off
        out["output_text_buffer_length"] = buffer
    if body.get("logit_bias") is not None:
        out["logit_bias"] = _logit_bias(body["logit_bias"])
    allowed = _ints(body, "allowed_token_ids")
    if allowed is not None:
        out["allowed_token_ids"] = allowed
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise ApiError("'vllm_xargs' must be an object", param="vllm_xargs")
    if api == "responses":
        out["extra_args"] = dict(xargs or {})
    elif xargs:
        out["extra_args"] = dict(xargs)
    bad_words = body.get("bad_words") or []
    if not (isinstance(bad_words, list) and all(isinstance(w, str) for w in bad_words)):
        raise ApiError("'bad_words' must be a list of strings", param="bad_words")
    if not all(bad_words):
        raise ApiError("bad_words cannot contain an empty string", param="bad_words")
    out["bad_words"] = list(dict.fromkeys(bad_words))
    out["skip_reading_prefix_cache"] = prompt_logprobs is not None
    budget = _thinking(body) if api == "messages" else body.get("thinking_token_budget")
    if budget is not None:
        # vLLM takes only a true integer here (no lax reading), -1 meaning no budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            raise ApiError(
                "`thinking_token_budget` must be a non-negative integer or -1 for unlimited",
                param="thinking_token_budget",
            )
        if budget != -1:
            out["thinking_token_budget"] = lax_int(budget, "thinking_token_budget")
    return out


def _thinking(body: dict[str, Any]) -> int | None:
    """An Anthropic body's thinking budget as vLLM's ``_handle_thinking`` maps it: an
    ``enabled`` thinking's ``budget_tokens`` (``adaptive`` pins nothing).

    :raises ApiError: a budget that is not an integer from 1024 to below ``max_tokens``.
    """
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = lax_int(thinking.get("budget_tokens"), "budget_tokens")
    if budget < 1024:  # pydantic's words
        raise ApiError(
            "thinking.budget_tokens: Input should be greater than or equal to 1024",
            param="thinking",
        )
    most = body.get("max_tokens")
    if most is not None and budget >= lax_int(most, "max_tokens"):
        raise ApiError("thinking.budget_tokens must be less than max_tokens", param="thinking")
    return budget


def _int(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    return default if value is None else lax_int(value, key)


def _ints(body: dict[str, Any], key: str) -> list[int] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError(f"'{key}' must be a list of integers", param=key)
    return [lax_int(v, key) for v in value]


def _logprobs(body: dict[str, Any], api: str, stream: bool) -> tuple[int | None, int | None]:
    """``(logprobs, prompt_logprobs)``: chat asks with ``logprobs: true`` and ``top_logprobs``,
    completions with an integer ``logprobs``; ``echo`` asks for the prompt's too."""
    if api == "responses":
        include = body.get("include")
        if isinstance(include, list) and "message.output_text.logprobs" in include:
            return _int(body, "top_logprobs", 0), None
        return None, None
    if api not in ("chat", "completion"):
        return None, None
    # vLLM's before-validators take numbers only for these, no numeric strings (chat's
    # ``logprobs`` is a lax bool)
    for key in ("prompt_logprobs", "top_logprobs" if api == "chat" else "logprobs"):
        if isinstance(body.get(key), str):
            raise ApiError(f"`{key}` must be an integer", param=key)
    prompt = _int(body, "prompt_logprobs", 0) if body.get("prompt_logprobs") is not None else None
    if prompt is not None:
        if prompt < -1:
            raise ApiError(
                "`prompt_logprobs` must be a positive value or -1", param="prompt_logprobs"
            )
        if stream and prompt != 0:
            raise ApiError(
                "`prompt_logprobs` are not available when `stream=True`", param="prompt_logprobs"
            )
    if api == "chat":
        top = _int(body, "top_logprobs", 0)
        if top < -1:
            raise ApiError("`top_logprobs` must be a positive value or -1", param="top_logprobs")
        wanted = flag(body, "logprobs", False)
        if top != 0 and not wanted:
            raise ApiError(
                "when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs"
            )
        logprobs = top if wanted else None
        if prompt is None and flag(body, "echo", False):
            prompt = top
    else:
        logprobs = None if body.get("logprobs") is None else lax_int(body["logprobs"], "logprobs")
        if prompt is None and flag(body, "echo", False):
            prompt = logprobs
    return logprobs, prompt


def _logit_bias(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ApiError("'logit_bias' must be an object", param="logit_bias")
    out: dict[str, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(
                f"logit_bias key {key[:20]!r} is not an integer token id", param="logit_bias"
            ) from None
        out[str(token)] = min(100.0, max(-100.0, lax_float(bias, "logit_bias")))  # vLLM's clamp
    return out
