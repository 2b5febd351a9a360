"""Request fields deepseek-recipe does not read, validated into what the gateway and engine use.

Sampling extensions (vLLM / SGLang / OpenAI) become ``SamplingParams`` keywords: ``top_k``,
``min_p``, the three penalties, ``logit_bias``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``prompt_logprobs`` (rendered by ``server.prompt_logprobs``), and deepserve's ``speculative``
(``false``: this request never drafts-and-verifies on an engine with speculative decoding on).
Gateway-side settings: ``n`` choices, ``priority``, ``skip_special_tokens``, ``parallel_tool_calls``,
chat ``echo``, ``truncate_prompt_tokens`` and the ``stream_options`` usage switches. Every bad value is a 400 naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.errors import InvalidRequest

_D = TypeVar("_D", bound="int | None")

MAX_CHOICES = 128  # n (or best_of) per prompt
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_LOGPROBS = 20  # alternatives per prompt token, as vLLM's default max_logprobs

# body key -> (low, high); inclusive bounds.
_FLOATS: dict[str, tuple[float, float]] = {
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (1e-6, 10.0),
    "min_p": (0.0, 1.0),
}


@dataclass(frozen=True)
class Extras:
    """What a request asks beyond the recipe's fields (defaults: the field was not sent)."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords
    n: int = 1
    priority: int = 0
    skip_special_tokens: bool = True
    parallel_tool_calls: bool = True
    echo: bool = False
    include_stop_str: bool = False  # include_stop_str_in_output
    include_usage: bool = False
    continuous_usage: bool = False
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: the context length


def truncated(ids: list[int], keep: int | None, context_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` ids (-1: the context length)."""
    if keep is None:
        return ids
    keep = context_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def int_field(body: dict[str, Any], key: str, low: int, high: int, default: _D) -> int | _D:
    """``body[key]``, an integer in ``[low, high]`` (not a bool), or ``default`` if missing or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"Invalid {key} value, {key} must be an integer in [{low}, {high}]", param=key)
    return value


def bool_field(body: dict[str, Any], key: str, default: bool = False) -> bool:
    """``body[key]``, a boolean, or ``default`` if missing or null."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"Invalid type for '{key}': expected a boolean.", param=key)
    return value


def _token_id(value: Any, vocab: int, param: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise InvalidRequest(f"Invalid token id {value!r} in '{param}' (valid: 0..{vocab - 1}).", param=param)
    return value


def logit_bias(body: dict[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI ``logit_bias``: ``{token id (string or int): bias in [-100, 100]}``."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases.", param="logit_bias"
        )
    out = []
    for key, bias in value.items():
        token = _token_id(key, vocab, "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"Invalid logit_bias value for token {key}: must be a number in [-100, 100].", param="logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def sampling_extensions(body: dict[str, Any], vocab: int) -> dict[str, Any]:
    """``SamplingParams`` keywords from the extension fields present in ``body``."""
    out: dict[str, Any] = {}
    for key, (low, high) in _FLOATS.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not low <= value <= high:
            raise InvalidRequest(f"Invalid {key} value, the valid range of {key} is [{low:g}, {high:g}]", param=key)
        out[key] = float(value)
    top_k = int_field(body, "top_k", -1, 1 << 30, 0)
    if top_k > 0:
        out["top_k"] = top_k  # 0 and -1 (vLLM's spelling) are "off"
    bias = logit_bias(body, vocab)
    if bias:
        out["logit_bias"] = bias
    min_tokens = int_field(body, "min_tokens", 0, 1 << 30, 0)
    if min_tokens:
        out["min_tokens"] = min_tokens
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids.", param="stop_token_ids")
        out["stop_token_ids"] = tuple(_token_id(t, vocab, "stop_token_ids") for t in stop_ids)
    if bool_field(body, "ignore_eos", False):
        out["ignore_eos"] = True
    prompt_logprobs = _prompt_logprobs(body)
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    if not bool_field(body, "speculative", True):
        out["speculative"] = False
    return out


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's ``prompt_logprobs`` count (an int; ``true`` reads as 1 and ``false`` as off, as
    vLLM's lax parsing has it); refused with ``stream``, as vLLM refuses it."""
    value = body.get("prompt_logprobs")
    if value is None or value is False:
        return None
    value = 1 if value is True else value
    if not isinstance(value, int) or not 0 <= value <= MAX_PROMPT_LOGPROBS:
        raise InvalidRequest(
            f"Invalid prompt_logprobs value, prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}]", param="prompt_logprobs"
        )
    if body.get("stream") is True:
        raise InvalidRequest("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    return value


def stream_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of ``stream_options``."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise InvalidRequest("Invalid type for 'stream_options': expected an object.", param="stream_options")
    if body.get("stream") is not True:
        raise InvalidRequest("The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise InvalidRequest(f"Unrecognized stream option: {key}", param=f"stream_options.{key}")
    include = bool_field(options, "include_usage", False)
    continuous = bool_field(options, "continuous_usage_stats", False)
    return include, continuous


def parse_extras(body: dict[str, Any], vocab: int, *, chat: bool = True) -> Extras:
    """All extension settings of ``body``; ``chat``: the Chat Completions-only ones too."""
    include, continuous = stream_usage(body)
    return Extras(
        sampling=sampling_extensions(body, vocab),
        n=int_field(body, "n", 1, MAX_CHOICES, 1),
        priority=int_field(body, "priority", -(1 << 31), (1 << 31) - 1, 0),
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        parallel_tool_calls=bool_field(body, "parallel_tool_calls", True),
        echo=bool_field(body, "echo", False) if chat else False,
        include_stop_str=bool_field(body, "include_stop_str_in_output", False),
        include_usage=include,
        continuous_usage=continuous,
        truncate_prompt_tokens=_truncation(body),
    )


def _truncation(body: dict[str, Any]) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
        raise InvalidRequest("Invalid truncate_prompt_tokens value: -1 or an integer >= 1.", param="truncate_prompt_tokens")
    return value
