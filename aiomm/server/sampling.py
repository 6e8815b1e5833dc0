"""``sampling_params`` as vLLM 0.33 derives them for a render response.

Defaults come from the model folder's ``generation_config.json`` (temperature, top_p, top_k,
repetition_penalty, ...), overridden by the request. ``max_tokens`` defaults to the model's
context length minus the prompt; vLLM's serialiser omits it when it equals its own default, 16.
Stop strings set ``output_text_buffer_length`` to the longest one's length minus one. A
``max_tokens`` above the model's context is refused, one above what the prompt leaves lowered to
it (vLLM's ``get_max_tokens``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .errors import ApiError
from .request_values import flag, lax_float, lax_int

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


def derive(
    body: dict[str, Any],
    defaults: SamplingDefaults,
    prompt_len: int,
    *,
    max_tokens_key: tuple[str, ...] = ("max_completion_tokens", "max_tokens"),
    extra_args: bool = False,
) -> dict[str, Any]:
    """The ``sampling_params`` object of a render response, validated as vLLM validates them
    (types as :mod:`.request_values` reads them, vLLM's ranges); a ``max_tokens`` above what
    the context leaves after the prompt is lowered to it, as vLLM does.

    :raises ApiError: a parameter of the wrong type or out of range, or a prompt longer than
        the context.
    """
    if prompt_len >= defaults.max_model_len:
        raise ApiError(
            f"the prompt has {prompt_len} tokens, the model's context is {defaults.max_model_len}"
        )
    d = defaults.values
    out: dict[str, Any] = {
        "presence_penalty": _float(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _float(
            body,
            "repetition_penalty",
            d.get("repetition_penalty", 1.0),
            0.0,
            math.inf,
            open_lo=True,
        ),
        "temperature": _float(body, "temperature", d.get("temperature", 1.0), 0.0, 2.0),
        "top_p": _float(body, "top_p", d.get("top_p", 1.0), 0.0, 1.0, open_lo=True),
    }
    top_k = body.get("top_k")
    top_k = int(d.get("top_k", 0)) if top_k is None else lax_int(top_k, "top_k", lo=-1)
    if top_k != 0:  # vLLM leaves out a top_k of 0 (seen with no generation_config.json)
        out["top_k"] = top_k
    out["min_p"] = _float(body, "min_p", d.get("min_p", 0.0), 0.0, 1.0)
    if body.get("seed") is not None:
        out["seed"] = lax_int(body["seed"], "seed")
    stop = body.get("stop") or body.get("stop_sequences") or []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError("'stop' must be a string or a list of strings", param="stop")
    out["stop"] = stop
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise ApiError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    out["stop_token_ids"] = [lax_int(t, "stop_token_ids") for t in stop_ids]
    room = defaults.max_model_len - prompt_len
    max_tokens = room
    for key in max_tokens_key:
        if body.get(key) is not None:
            asked = lax_int(body[key], key)
            if asked > defaults.max_model_len:
                raise ApiError(
                    f"{key}={asked} cannot be greater than max_model_len={defaults.max_model_len}",
                    param=key,
                )
            if asked < 1:
                raise ApiError(f"{key} must be at least 1, got {asked}", param=key)
            max_tokens = min(asked, room)
            break
    if max_tokens != _VLLM_DEFAULT_MAX_TOKENS:
        out["max_tokens"] = max_tokens
    out["output_kind"] = 1 if flag(body, "stream", False) else 2  # DELTA or FINAL_ONLY
    out["skip_clone"] = True
    buffer = max((len(s) for s in stop), default=1) - 1
    if buffer > 0:
        out["output_text_buffer_length"] = buffer
    if extra_args:
        out["extra_args"] = {}
    out["bad_words"] = []
    out["skip_reading_prefix_cache"] = False
    return out
