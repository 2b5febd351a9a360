"""From a converted protocol request (deepseek-recipe) to the engine's ``GenerateRequest``.

Pure functions, no I/O: the prompt is already encoded. Mapping:
- ``max_tokens``: ``ConversationRequest.resolve_max_tokens(prompt, context)`` (its defaults; 400 when
  the prompt does not fit).
- temperature / top_p / seed / logprobs / top_logprobs: ``InferenceOptions`` as resolved by the recipe.
- temperature / top_p in thinking mode: the recipe forces 1.0 (DeepSeek's official API); by default
  the client's values are used instead (``temperature: 0`` is greedy in thinking mode too), unless
  the server runs with ``official_thinking_sampling``.
- sampling extensions (penalties, ``top_k``, ``min_p``, ``logit_bias``, ``min_tokens``,
  ``stop_token_ids``, ``ignore_eos``): ``server.extensions``, validated with OpenAI's / vLLM's ranges.
- ``stop_token_ids``: EOS (unless ``ignore_eos``) plus the client's. Stop *strings* stay in the
  gateway (the recipe's ParsingOptions), which aborts the engine request when one matches.
- the output constraint: ``server.structured`` (the recipe's kind with the client's own schemas,
  or a vLLM / SGLang extension field; in thinking mode it applies only after ``</think>``).
"""

from __future__ import annotations

import math
from typing import Any

from deepserve.protocol import GenerateRequest, SamplingParams
from server.errors import ContextLengthExceeded, InvalidRequest, from_conversion_error
from server.extensions import Extras
from server.structured import recipe_constraint


def session_key(body: dict[str, Any]) -> str | None:
    """A stable per-user/conversation key for session-affinity routing, if the client sent one."""
    for key in ("prompt_cache_key", "user", "safety_identifier"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        return meta["user_id"]
    return None


def resolve_max_tokens(conv_req: Any, prompt_len: int, context_len: int) -> int:
    if prompt_len >= context_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_len} tokens. However, your messages "
            f"resulted in {prompt_len} tokens. Please reduce the length of the messages.",
            param="messages",
        )
    try:
        return int(conv_req.resolve_max_tokens(prompt_len, context_len))
    except Exception as exc:  # deepseek_recipe.ConversionError: its refusal here is prompt + max_tokens > context
        err = from_conversion_error(exc)
        raise ContextLengthExceeded(err.message, param=err.param or "messages") from None


def client_sampling(body: dict[str, Any]) -> tuple[float, float]:
    """(temperature, top_p) as the client sent them (defaults 1.0), validated."""
    out = []
    for key, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = body.get(key)
        if value is None:
            out.append(1.0)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= high:
            raise InvalidRequest(f"Invalid {key} value, the valid range of {key} is [0, {high:g}]", param=key)
        out.append(float(value))
    return out[0], out[1]


def build_generate_request(
    request_id: str,
    prompt_ids: list[int],
    conv_req: Any,
    body: dict[str, Any],
    *,
    context_len: int,
    eos_token_id: int,
    thinking_end_id: int,
    extras: Extras | None = None,
    official_thinking_sampling: bool = False,
    compact_json: bool = False,
) -> GenerateRequest:
    """The engine request for a converted Chat Completions / Responses / Messages request."""
    extras = extras or Extras()
    opts = conv_req.inference_options
    max_tokens = resolve_max_tokens(conv_req, len(prompt_ids), context_len)
    if conv_req.conversation.thinking_mode and not official_thinking_sampling:
        temperature, top_p = client_sampling(body)
    else:
        # The recipe holds these as float32: round back to the decimal the client sent.
        temperature = 1.0 if opts.temperature is None else round(float(opts.temperature), 6)
        top_p = 1.0 if opts.top_p is None else round(float(opts.top_p), 6)
    extra = dict(extras.sampling)
    if extra.get("min_tokens", 0) > max_tokens:
        raise InvalidRequest(f"min_tokens ({extra['min_tokens']}) must be at most max_tokens ({max_tokens}).", param="min_tokens")
    stop_ids = () if extra.get("ignore_eos") else (eos_token_id,)
    extra["stop_token_ids"] = stop_ids + tuple(extra.get("stop_token_ids", ()))
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=min(1.0, max(1e-6, top_p)),  # 0: most likely only
        seed=opts.seed,
        logprobs=bool(opts.logprobs),
        top_logprobs=int(opts.top_logprobs or 0) if opts.logprobs else 0,
        constraint=recipe_constraint(
            body, opts.output_constraint, conv_req.parsing_options, thinking_end_id, compact=compact_json
        ),
        **extra,
    )
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        priority=extras.priority,
        session_key=session_key(body),
    )
