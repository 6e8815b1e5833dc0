"""``sampling_params`` as vLLM 0.33 derives them for a render response.

Defaults come from the model folder's ``generation_config.json`` (temperature, top_p, top_k,
repetition_penalty, ...), overridden by the request. ``max_tokens`` defaults to the model's
context length minus the prompt; vLLM's serialiser omits it when it equals its own default, 16.
Stop strings set ``output_text_buffer_length`` to the longest one's length minus one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ApiError

__all__ = ("SamplingDefaults", "derive")

_FROM_GENERATION_CONFIG = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p")
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
        return cls({k: gen[k] for k in _FROM_GENERATION_CONFIG if k in gen}, max_len)


def _number(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{key}' must be a number", param=key)
    return value


def derive(
    body: dict[str, Any],
    defaults: SamplingDefaults,
    prompt_len: int,
    *,
    max_tokens_key: tuple[str, ...] = ("max_completion_tokens", "max_tokens"),
    extra_args: bool = False,
) -> dict[str, Any]:
    """The ``sampling_params`` object of a render response.

    :raises ApiError: a parameter of the wrong type, or a prompt longer than the context.
    """
    if prompt_len >= defaults.max_model_len:
        raise ApiError(
            f"the prompt has {prompt_len} tokens, the model's context is {defaults.max_model_len}"
        )
    d = defaults.values
    out: dict[str, Any] = {
        "presence_penalty": float(_number(body, "presence_penalty", 0.0)),
        "frequency_penalty": float(_number(body, "frequency_penalty", 0.0)),
        "repetition_penalty": float(
            _number(body, "repetition_penalty", d.get("repetition_penalty", 1.0))
        ),
        "temperature": float(_number(body, "temperature", d.get("temperature", 1.0))),
        "top_p": float(_number(body, "top_p", d.get("top_p", 1.0))),
    }
    top_k = int(_number(body, "top_k", d.get("top_k", 0)))
    if top_k != 0:  # vLLM leaves out a top_k of 0 (seen with no generation_config.json)
        out["top_k"] = top_k
    out["min_p"] = float(_number(body, "min_p", d.get("min_p", 0.0)))
    seed = _number(body, "seed", None)
    if seed is not None:
        out["seed"] = int(seed)
    stop = body.get("stop") or body.get("stop_sequences") or []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError("'stop' must be a string or a list of strings", param="stop")
    out["stop"] = stop
    out["stop_token_ids"] = list(body.get("stop_token_ids") or [])
    max_tokens = None
    for key in max_tokens_key:
        max_tokens = _number(body, key, None)
        if max_tokens is not None:
            break
    if max_tokens is None:
        max_tokens = defaults.max_model_len - prompt_len
    if int(max_tokens) < 1:
        raise ApiError("max_tokens must be at least 1", param="max_tokens")
    if int(max_tokens) != _VLLM_DEFAULT_MAX_TOKENS:
        out["max_tokens"] = int(max_tokens)
    out["output_kind"] = 2
    out["skip_clone"] = True
    buffer = max((len(s) for s in stop), default=1) - 1
    if buffer > 0:
        out["output_text_buffer_length"] = buffer
    if extra_args:
        out["extra_args"] = {}
    out["bad_words"] = []
    out["skip_reading_prefix_cache"] = False
    return out
