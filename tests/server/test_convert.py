"""Converted protocol requests -> GenerateRequest (sampling, constraint, max_tokens, context)."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from server.convert import build_generate_request, session_key
from server.errors import ContextLengthExceeded, InvalidRequest
from server.extensions import parse_extras, sampling_extensions
from tests.server.conftest import MODEL

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


def build(catalog, body: dict, prompt_len: int = 10, context: int = 4096, official: bool = False):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    conv = dr.ChatCompletionRequest(body).convert(catalog.conversion)
    return build_generate_request(
        "req-1", list(range(prompt_len)), conv, body,
        context_len=context, eos_token_id=catalog.eos_token_id, thinking_end_id=catalog.thinking_end_id,
        extras=parse_extras(body, catalog.vocab_size), official_thinking_sampling=official,
    )


def test_sampling_mapping(catalog):
    req = build(catalog, {
        "max_tokens": 33, "temperature": 0.3, "top_p": 0.9, "seed": 11, "logprobs": True, "top_logprobs": 3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "thinking": {"type": "disabled"}, "user": "u1",
    })
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (33, 0.3, 0.9, 11)
    assert s.logprobs and s.top_logprobs == 3
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert s.stop_token_ids == (catalog.eos_token_id,) and s.constraint is None
    assert req.request_id == "req-1" and req.session_key == "u1"
    GenerateRequestRoundTrip = type(req).from_dict(json.loads(json.dumps(req.to_dict())))
    assert GenerateRequestRoundTrip.sampling == s


def test_thinking_keeps_client_temperature_unless_official_and_defaults_max_tokens(catalog):
    req = build(catalog, {"temperature": 0, "top_p": 0.5}, prompt_len=100, context=1000)
    assert (req.sampling.temperature, req.sampling.top_p) == (0.0, 0.5) and req.sampling.greedy
    assert req.sampling.max_tokens == 900  # default lowered to the context left
    official = build(catalog, {"temperature": 0.2}, official=True).sampling
    assert official.temperature == 1.0  # the recipe's rule (DeepSeek's API) in thinking mode


def test_extensions_reach_the_engine_request(catalog):
    req = build(catalog, {
        "thinking": {"type": "disabled"}, "max_tokens": 20, "min_tokens": 4, "logit_bias": {"42": 100, "7": -5.5},
        "stop_token_ids": [9, 10], "priority": -3, "seed": 5,
    })
    s = req.sampling
    assert s.min_tokens == 4 and s.logit_bias == ((42, 100.0), (7, -5.5)) and req.priority == -3
    assert s.stop_token_ids == (catalog.eos_token_id, 9, 10) and not s.ignore_eos
    s = build(catalog, {"ignore_eos": True, "stop_token_ids": [9]}).sampling
    assert s.ignore_eos and s.stop_token_ids == (9,)  # EOS must not stop an ignore_eos request
    assert not build(catalog, {"speculative": False}).sampling.speculative and build(catalog, {}).sampling.speculative
    with pytest.raises(InvalidRequest) as err:
        build(catalog, {"max_tokens": 3, "min_tokens": 4})
    assert err.value.param == "min_tokens"


def test_constraints_and_trigger(catalog):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    c = build(catalog, {"response_format": rf}).sampling.constraint
    assert c.kind == "json" and json.loads(c.spec) == schema and c.trigger_token_ids == (catalog.thinking_end_id,)
    c = build(catalog, {"response_format": rf, "thinking": {"type": "disabled"}}).sampling.constraint
    assert c.trigger_token_ids == ()
    c = build(catalog, {"response_format": {"type": "json_object"}, "messages": [{"role": "user", "content": "json please"}]}).sampling.constraint
    assert c.kind == "json" and c.spec == ""
    c = build(catalog, {"tools": TOOLS}).sampling.constraint
    assert c.kind == "tool_call" and json.loads(c.spec)[0]["function"]["name"] == "f"
    c = build(catalog, {"tools": TOOLS, "tool_choice": "required", "thinking": {"type": "disabled"}}).sampling.constraint
    assert c.kind == "tool_call_required" and c.trigger_token_ids == ()  # the prompt opened the block


def test_context_errors(catalog):
    with pytest.raises(ContextLengthExceeded):
        build(catalog, {"max_tokens": 100}, prompt_len=4000, context=4096)
    with pytest.raises(ContextLengthExceeded):
        build(catalog, {}, prompt_len=4096, context=4096)


def test_sampling_extensions_validation():
    V = 129280
    assert sampling_extensions({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}, V) == {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}
    assert sampling_extensions({"top_k": -1}, V) == {}  # vLLM's "off"
    assert sampling_extensions({"speculative": False}, V) == {"speculative": False}  # deepserve's opt-out
    assert sampling_extensions({"speculative": True}, V) == {}
    bad_values = [
        ("presence_penalty", 3), ("frequency_penalty", "x"), ("top_k", -2), ("top_k", True), ("min_p", 2),
        ("logit_bias", {"129280": 1}), ("logit_bias", {"5": 101}), ("logit_bias", [1]), ("logit_bias", {"x": 1}),
        ("stop_token_ids", [-1]), ("stop_token_ids", "1"), ("min_tokens", -1), ("ignore_eos", "yes"),
        ("speculative", "no"),
    ]
    for key, value in bad_values:
        with pytest.raises(InvalidRequest) as err:
            sampling_extensions({key: value}, V)
        assert err.value.param == key
    for key, value in (("n", 0), ("n", 129), ("priority", "high"), ("skip_special_tokens", 1), ("parallel_tool_calls", "no")):
        with pytest.raises(InvalidRequest) as err:
            parse_extras({key: value}, V)
        assert err.value.param == key
    assert session_key({"metadata": {"user_id": "abc"}}) == "abc" and session_key({}) is None
