"""From a converted protocol request (deepseek-recipe) to the engine's ``GenerateRequest``.

Pure functions, no I/O: the prompt is already encoded. Mapping:
- ``max_tokens``: ``ConversationRequest.resolve_max_tokens(prompt, context)`` (its defaults; 400 when
  the prompt does not fit).
- temperature / top_p / seed / logprobs / top_logprobs: ``InferenceOptions`` as resolved by the recipe.
- penalties and ``top_k`` / ``min_p`` / ``repetition_penalty`` (vLLM-style extensions): read from the
  body here, since the recipe does not extract them; validated with OpenAI's ranges.
- ``stop_token_ids``: EOS. Stop *strings* stay in the gateway (the recipe's ParsingOptions), which
  aborts the engine request when one matches.
- the output constraint: recipe ``(kind, schema)`` -> ``OutputConstraint(kind, spec, trigger)``, the
  trigger being the thinking-end token when the answer starts in reasoning, so the grammar applies
  only after ``</think>``.
"""

from __future__ import annotations

import math
from typing import Any

from engine.protocol import GenerateRequest, OutputConstraint, SamplingParams
from server.errors import ContextLengthExceeded, InvalidRequest, from_conversion_error

# body key -> (SamplingParams field, low, high); inclusive bounds.
_EXTRA_FLOATS: dict[str, tuple[str, float, float]] = {
    "presence_penalty": ("presence_penalty", -2.0, 2.0),
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0),
    "repetition_penalty": ("repetition_penalty", 1e-6, 10.0),
    "min_p": ("min_p", 0.0, 1.0),
}


def extra_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Sampling settings the recipe leaves in the body, validated (400 on a bad value)."""
    out: dict[str, Any] = {}
    for key, (name, low, high) in _EXTRA_FLOATS.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high or math.isnan(value):
            raise InvalidRequest(f"Invalid {key} value, the valid range of {key} is [{low:g}, {high:g}]", param=key)
        out[name] = float(value)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidRequest("Invalid top_k value, top_k must be an integer >= 0", param="top_k")
        out["top_k"] = top_k
    return out


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


def output_constraint(recipe_constraint: Any, parsing_options: Any, thinking_end_id: int) -> OutputConstraint | None:
    """Recipe ``OutputConstraint(kind, schema)`` -> engine ``OutputConstraint``."""
    if recipe_constraint is None:
        return None
    stage = parsing_options.thinking_initial_stage
    in_reasoning = (
        stage is not None and stage.starts_in_reasoning() and not parsing_options.starts_in_tool_calls
    )
    trigger = (thinking_end_id,) if in_reasoning else ()
    return OutputConstraint(kind=recipe_constraint.kind, spec=recipe_constraint.schema, trigger_token_ids=trigger)


def resolve_max_tokens(conv_req: Any, prompt_len: int, context_len: int) -> int:
    if prompt_len >= context_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_len} tokens. However, your messages "
            f"resulted in {prompt_len} tokens. Please reduce the length of the messages.",
            param="messages",
        )
    try:
        return int(conv_req.resolve_max_tokens(prompt_len, context_len))
    except Exception as exc:  # deepseek_recipe.ConversionError
        raise from_conversion_error(exc) from None


def build_generate_request(
    request_id: str,
    prompt_ids: list[int],
    conv_req: Any,
    body: dict[str, Any],
    *,
    context_len: int,
    eos_token_id: int,
    thinking_end_id: int,
) -> GenerateRequest:
    """The engine request for a converted Chat Completions / Responses / Messages request."""
    opts = conv_req.inference_options
    max_tokens = resolve_max_tokens(conv_req, len(prompt_ids), context_len)
    temperature = opts.temperature
    top_p = opts.top_p
    sampling = SamplingParams(
        max_tokens=max_tokens,
        # The recipe holds these as float32: round back to the decimal the client sent.
        temperature=1.0 if temperature is None else round(float(temperature), 6),
        top_p=1.0 if top_p is None else min(1.0, max(1e-6, round(float(top_p), 6))),  # 0: most likely only
        seed=opts.seed,
        stop_token_ids=(eos_token_id,),
        logprobs=bool(opts.logprobs),
        top_logprobs=int(opts.top_logprobs or 0) if opts.logprobs else 0,
        constraint=output_constraint(opts.output_constraint, conv_req.parsing_options, thinking_end_id),
        **extra_sampling(body),
    )
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        session_key=session_key(body),
    )
