"""Schemathesis fuzzing of a running gateway (shared by the fake-engine and the live-stack runs)."""

from __future__ import annotations

from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode
from schemathesis.openapi import from_url

# Generation endpoints get a small output budget so a fuzz run on a CPU model stays short.
_BUDGET_KEYS = ("max_tokens", "max_output_tokens")


def _cap_budget(case: Any, limit: int) -> None:
    body = case.body
    if isinstance(body, dict) and case.method == "POST":
        for key in _BUDGET_KEYS:
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > limit:
                body[key] = limit
        if not any(k in body for k in _BUDGET_KEYS):
            body["max_output_tokens" if case.path == "/v1/responses" else "max_tokens"] = limit


def fuzz(
    base_url: str, *, max_examples: int = 30, max_tokens: int = 8, headers: dict[str, str] | None = None,
    modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
) -> dict[str, int]:
    """Cases of each of ``modes`` (positive: valid by the schema; negative: not) for every operation;
    asserts no 5xx and the server stays up. Returns the count of responses per status class, for
    the test's report."""
    schema = from_url(base_url + "/openapi.json")
    seen: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in modes:

            @settings(
                max_examples=max_examples, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                _cap_budget(case, max_tokens)
                response = case.call(base_url=base_url, headers=headers, timeout=60)
                seen[f"{response.status_code // 100}xx"] = seen.get(f"{response.status_code // 100}xx", 0) + 1
                assert response.status_code < 500, (
                    f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}\nbody: {case.body!r}"[:2000]
                )
                if response.status_code >= 400 and response.text.startswith("{"):
                    assert "error" in response.json(), response.text  # OpenAI- or Anthropic-shaped

            try:
                check()
            except Unsatisfiable:  # nothing to break in a parameterless GET: no negative cases
                assert mode is GenerationMode.NEGATIVE, operation
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    return seen
