"""The router service's request parsing equals ``GenerateRequest.from_dict`` (its fast paths)."""

from __future__ import annotations

import pytest

from engine.protocol import GenerateRequest, SamplingParams
from router.service import parse_generate


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"max_tokens": 1, "temperature": 0.0},
        {"max_tokens": 1, "temperature": 0},
        {"max_tokens": 4, "temperature": 1, "logprobs": True, "top_logprobs": 2},
        {"max_tokens": 4, "temperature": 1, "logprobs": 1, "top_logprobs": 2},
        {"max_tokens": 8, "stop_token_ids": [3, 4], "seed": 7},
        {"max_tokens": 8, "constraint": {"kind": "regex", "spec": "a+", "trigger_token_ids": [9]}},
        {"max_tokens": 2, "unknown_field": "ignored"},
    ],
)
def test_sampling_equals_from_dict_also_when_memoised(sampling):
    body = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling": sampling}
    want = GenerateRequest.from_dict(body).sampling
    for _ in range(2):  # the second parse may come from the memo
        got = parse_generate(body).sampling
        assert got == want
        assert {k: type(v) for k, v in got.__dict__.items()} == {k: type(v) for k, v in want.__dict__.items()}


def test_invalid_sampling_is_refused_every_time():
    body = {"request_id": "r", "prompt_token_ids": [1], "sampling": {"max_tokens": 0}}
    for _ in range(2):
        with pytest.raises(ValueError):
            parse_generate(body)
    assert parse_generate({"request_id": "r", "prompt_token_ids": [1]}).sampling == SamplingParams()
