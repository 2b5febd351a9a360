"""The router service's request parsing equals ``GenerateRequest.from_dict`` (its fast paths)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from deepserve.protocol import GenerateRequest, SamplingParams
from router.service import forward_head, parse_generate


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


def _forwarded(body: dict, **router_fields) -> dict:
    """What the worker parses from the client's body forwarded with the router's fields."""
    raw = json.dumps(body).encode() + b"\n"
    d = json.loads(raw)
    req = parse_generate(d, raw)
    head = forward_head(d, raw, req)
    assert head is not None
    tail = b"".join(b',"%s":%s' % (k.encode(), json.dumps(v).encode()) for k, v in router_fields.items())
    return json.loads(b"".join([*head, tail, b"}"])), req


@pytest.mark.parametrize("extra", [{}, {"arrival_time": 123.5, "priority": 2, "session_key": "s"}, {"output_token_ids": [5, 6], "dp_rank": 3, "prefill_only": True}])
def test_forwarded_body_reads_as_the_encoded_request(extra):
    body = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4, "temperature": 0.0}, **extra}
    got, req = _forwarded(body, dp_rank=1, prefill_only=False)
    want = replace(req, dp_rank=1, prefill_only=False)
    assert GenerateRequest.from_dict(got) == want  # arrival_time too: the router's clock when absent
    assert json.loads(json.dumps(want.to_dict())) == GenerateRequest.from_dict(got).to_dict()
    got, req = _forwarded(body, dp_rank=0, prefill_only=True, output_token_ids=[7])
    assert GenerateRequest.from_dict(got) == replace(req, dp_rank=0, prefill_only=True, output_token_ids=[7])


@pytest.mark.parametrize("extra", [{"request_id": 5}, {"output_token_ids": None}, {"arrival_time": None}, {"arrival_time": 0}, {"arrival_time": True}])
def test_bodies_the_worker_would_read_differently_are_encoded(extra):
    body = {"request_id": "r", "prompt_token_ids": [1, 2, 3], **extra}
    raw = json.dumps(body).encode()
    assert forward_head(json.loads(raw), raw, parse_generate(json.loads(raw), raw)) is None


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


_READ_AS_TEXT = (  # canonical prompts: read off the body as text (kvstore.keys.TokenIdsText)
    b'{"request_id":"r","prompt_token_ids":[1,2,3]}',
    b'{"request_id":"r","prompt_token_ids":[0,12,3],"output_token_ids":[4],"sampling":{"max_tokens":3}}',
    b'{"request_id":"r","prompt_token_ids" : [5]}\n',
)


@pytest.mark.parametrize(
    "raw",
    [
        *_READ_AS_TEXT,
        b'{"request_id":"r","prompt_token_ids":[7,8],"session_key":"prompt_token_ids"}',  # key seen twice
        b'{"request_id":"r","prompt_token_ids":[1, 2]}',  # blanks: parsed whole
        b'{"request_id":"r","prompt_token_ids":[1,0,2]}',  # the id 0 after the first: parsed whole
        b'{"request_id":"r","prompt_token_ids":[-1,2]}',
        b'{"request_id":"r","prompt_token_ids":[01,2]}',  # not JSON
        b'{"request_id":"r","prompt_token_ids":[1,,2]}',
        b'{"request_id":"r","prompt_token_ids":[1,2,]}',
        b'{"request_id":"r","prompt_token_ids":[,1]}',
        b'{"request_id":"r","prompt_token_ids":[]}',
        b'{"request_id":"r","prompt_token_ids":[1,2.5]}',
        b'{"request_id":"r","prompt_token_ids":[1,true]}',
        b'{"request_id":"r","sampling":{"prompt_token_ids":[1]}}',  # only nested: no prompt
        b'{"request_id":"prompt_token_ids","x":[1,2]}',  # the key's text as a value
        b'{"request_id":"r","prompt_token_ids":{"a":[1,2]}}',
        b'{"request_id":"r\\u0030","prompt_token_ids":[1,2,3]}',  # a backslash: parsed whole
        b'{"request_id":"r","prompt_token_ids":[1,2,3]',  # truncated
        b'[{"request_id":"r","prompt_token_ids":[1,2,3]}]',
    ],
)
def test_parse_body_equals_parsing_the_whole_body(raw):
    """``parse_body`` (the service's parse, prompt read off the text when canonical) accepts and
    refuses exactly what parsing the whole body does, with the same request."""
    from kvstore.keys import TokenIdsText
    from router.service import BadRequest, parse_body

    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise BadRequest("body must be a JSON object")
        want: GenerateRequest | type = parse_generate(d, raw)
    except (KeyError, ValueError, TypeError) as exc:
        want = type(exc)
    try:
        got_d, got = parse_body(raw)
    except (KeyError, ValueError, TypeError) as exc:
        assert want is type(exc) or issubclass(want, ValueError) and isinstance(exc, ValueError)
        return
    assert isinstance(want, GenerateRequest), f"accepted a body whole parsing refuses: {raw!r}"
    assert replace(got, prompt_token_ids=list(got.prompt_token_ids), arrival_time=0) == replace(want, arrival_time=0)
    assert forward_head(got_d, raw, got) == forward_head(d, raw, want) or "arrival_time" not in d
    assert (type(got.prompt_token_ids) is TokenIdsText) == (raw in _READ_AS_TEXT)
