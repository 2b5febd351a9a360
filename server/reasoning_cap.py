"""Reasoning token caps: Anthropic's ``thinking.budget_tokens`` and Responses ``reasoning.max_tokens``.

In thinking mode the answer starts inside the reasoning. With a cap the engine allows only the
thinking-end token once that many output tokens are out and the reasoning is still open
(``SamplingParams.max_reasoning_tokens``, ``engine/sampling/penalties.py``), so the reasoning
never runs longer and the answer follows within ``max_tokens``. A cap on a request that does not
start in the reasoning (thinking disabled) changes nothing, and one at or above ``max_tokens`` never
binds (Anthropic refuses that; it is accepted here, as clients written for the recipe send it).
Bad values are a 400 naming the field, as are keys of the Responses ``reasoning`` object this
server does not know.
"""

from __future__ import annotations

from typing import Any

from server.errors import InvalidRequest

# Responses ``reasoning`` keys: effort (thinking effort), summary / generate_summary (accepted:
# the reasoning is returned in full as the reasoning item's content), max_tokens (the cap).
REASONING_KEYS = ("effort", "summary", "generate_summary", "max_tokens")


def _positive(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"Invalid {param}: expected a positive integer.", param=param)
    return value


def requested_cap(body: dict[str, Any], route: str) -> int | None:
    """The reasoning cap ``body`` asks for on ``route`` (None: none)."""
    if route == "/v1/messages":
        thinking = body.get("thinking")
        if not isinstance(thinking, dict) or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
            return None
        return _positive(thinking["budget_tokens"], "thinking.budget_tokens")
    if route == "/v1/responses":
        reasoning = body.get("reasoning")
        if not isinstance(reasoning, dict):
            return None
        for key in reasoning:
            if key not in REASONING_KEYS:
                raise InvalidRequest(f"Unrecognized reasoning argument supplied: {key}", param=f"reasoning.{key}", code="unknown_parameter")
        cap = reasoning.get("max_tokens")
        return None if cap is None else _positive(cap, "reasoning.max_tokens")
    return None


def cap_sampling(cap: int | None, conv: Any, thinking_end_id: int) -> dict[str, int]:
    """The ``SamplingParams`` keywords of a cap on converted request ``conv`` ({} when it does not
    apply: no cap, or an answer that does not start in the reasoning)."""
    stage = conv.parsing_options.thinking_initial_stage
    if cap is None or stage is None or not stage.starts_in_reasoning():
        return {}
    return {"max_reasoning_tokens": cap, "reasoning_end_id": thinking_end_id}
