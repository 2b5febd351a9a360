"""The router service's request parsing equals the checked ``GenerateRequest.from_dict`` (its memo and type checks)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from deepserve.protocol import GenerateRequest, SamplingParams
from router.service import parse_generate


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"max_tokens": 1, "temperature": 0.0},
        {"max_tokens": 1, "temperature": 0},
        {"max_tokens": 4, "temperature": 1, "logprobs": True, "top_logprobs": 2},
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


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"logprobs": 1}, {"top_k": 1e20}, {"seed": "x"}, {"constraint": {"kind": "json", "spec": {}}}])
def test_invalid_sampling_is_refused_every_time(bad):
    body = {"request_id": "r", "prompt_token_ids": [1], "sampling": bad}
    for _ in range(2):
        with pytest.raises(ValueError):
            parse_generate(body)
    assert parse_generate({"request_id": "r", "prompt_token_ids": [1]}).sampling == SamplingParams()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id":"r","prompt_token_ids":[1,2,3]}',
        b'{"request_id": "r", "prompt_token_ids" : [1, -2, 3], "sampling": {"ignore_eos": true}}',
        b'{"request_id":"r","prompt_token_ids":[1,2],"output_token_ids":[4],"session_key":"[true]"}',
        b'{"request_id":"r\\u0030","prompt_token_ids":[1,2,3]}',  # a backslash: types looked at
        b'{"request_id":"r","sampling":{"prompt_token_ids":[true]},"prompt_token_ids":[1]}',  # seen twice
    ],
)
def test_integer_token_ids_are_accepted(raw):
    d = json.loads(raw)
    req = parse_generate(d, raw)
    assert req.prompt_token_ids == d["prompt_token_ids"]
    assert req.output_token_ids == d.get("output_token_ids", [])


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id":"r","prompt_token_ids":[1,true,3]}',
        b'{"request_id":"r","prompt_token_ids":[false]}',
        b'{"request_id":"r","prompt_token_ids":[1,2.0]}',
        b'{"request_id":"r","prompt_token_ids":[1,2e3]}',
        b'{"request_id":"r","prompt_token_ids":[1,"2"]}',
        b'{"request_id":"r","prompt_token_ids":[1,null]}',
        b'{"request_id":"r","prompt_token_ids":[1,[2]]}',
        b'{"request_id":"r","prompt_token_ids":[1,{"a":2}]}',
        b'{"request_id":"r","prompt_token_ids":[]}',
        b'{"request_id":"r","prompt_token_ids":"[1,2]"}',
        b'{"request_id":"r","prompt_token_ids":[1],"output_token_ids":[true]}',
        # the real field hidden behind an escape, a decoy with integers in plain text
        b'{"request_id":"r","x":{"prompt_token_ids":[1]},"prompt\\u005ftoken_ids":[true]}',
        b'{"request_id":"r","\\"prompt_token_ids":[1],"prompt\\u005ftoken_ids":[true]}',
        # duplicate keys: JSON parsers take the last
        b'{"request_id":"r","prompt_token_ids":[1],"prompt_token_ids":[true]}',
    ],
)
def test_token_ids_that_are_not_integers_are_refused(raw):
    d = json.loads(raw)
    with pytest.raises(ValueError, match="token ids"):
        parse_generate(d, raw)
    with pytest.raises(ValueError, match="token ids"):
        parse_generate(d)  # no body to read: each element's type is looked at


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id":"r","prompt_token_ids":[1,2,3]}',
        b'{"request_id":"r","prompt_token_ids":[0,12,3],"output_token_ids":[4],"sampling":{"max_tokens":3},"dp_rank":1}',
        b'{"request_id":"r","prompt_token_ids":[7,8],"session_key":"prompt_token_ids","priority":2,"arrival_time":12.5}',
        b'{"request_id":"r","prompt_token_ids":[1,0,2],"prefill_only":true}',
        b'{"request_id":"r","prompt_token_ids":[1,2,3]',  # truncated
        b'[{"request_id":"r","prompt_token_ids":[1,2,3]}]',
        b'{"request_id":"r","sampling":{"prompt_token_ids":[1]}}',  # only nested: no prompt
        b'{"request_id":"r","prompt_token_ids":[1],"sampling":[1]}',
    ],
)
def test_parse_body_is_the_typed_request(raw):
    """``parse_body`` (the service's one parse) accepts exactly what the worker's checked
    ``from_dict`` accepts, giving the same request."""
    from deepserve.protocol.validate import check_generate
    from router.service import parse_body

    try:
        d = json.loads(raw)
        want: GenerateRequest | None = GenerateRequest.from_dict(check_generate(d))
    except (KeyError, ValueError, TypeError, AttributeError):
        want = None
    if want is None:
        with pytest.raises((KeyError, ValueError, TypeError)):
            parse_body(raw)
        return
    got = parse_body(raw)
    assert replace(got, arrival_time=0) == replace(want, arrival_time=0)
    if "arrival_time" in d:
        assert got.arrival_time == want.arrival_time
