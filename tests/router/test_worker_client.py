"""WorkerClient: request encoding, events, and every transport failure's router error (the
transports themselves: test_transport_contract.py)."""

from __future__ import annotations

import json

import pytest

from deepserve.protocol import ErrorCode, GenerateRequest, OutputConstraint, SamplingParams, TokenEvent, error_body, parse_error_body
from router.errors import WorkerRejected, WorkerUnavailable
from router.transport import ConnectError, DeadlineError, ProtocolError, StatusError
from router.worker_client import WorkerClient, encode_request, event_from_dict


def test_encode_request_equals_to_dict():
    req = GenerateRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(max_tokens=5, stop_token_ids=(7,), constraint=OutputConstraint("json", "{}", (9,))),
        output_token_ids=[4],
        dp_rank=1,
        session_key="s",
    )
    assert json.loads(encode_request(req)) == json.loads(json.dumps(req.to_dict()))


@pytest.mark.parametrize(
    "d",
    [
        {"request_id": "a", "token_ids": [1, 2]},
        {"request_id": "a", "token_ids": [3], "finish_reason": "stop", "num_prompt_tokens": 9, "num_cached_tokens": 8, "worker_id": "w"},
        {"request_id": "a", "token_ids": [3], "logprobs": [[-0.5, [[3, -0.5], [4, -1.0]]]]},
        {"request_id": "a", "finish_reason": "error", "error": "boom"},
    ],
)
def test_event_from_dict_matches_protocol(d):
    assert event_from_dict(d) == TokenEvent.from_dict(d)


def _body(code: ErrorCode) -> bytes:
    return json.dumps(error_body(code, "why")).encode()


@pytest.mark.parametrize(
    "exc,cls,code",
    [
        (StatusError(503, _body(ErrorCode.ENGINE_FULL)), WorkerUnavailable, ErrorCode.ENGINE_FULL),
        (StatusError(400, _body(ErrorCode.CONTEXT_LENGTH_EXCEEDED)), WorkerRejected, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        (StatusError(502, _body(ErrorCode.ENGINE_ERROR)), WorkerUnavailable, ErrorCode.ENGINE_ERROR),
        (StatusError(400, b"bad"), WorkerRejected, ErrorCode.INVALID_REQUEST),  # no code: by status
        (StatusError(401, b"token"), WorkerUnavailable, ErrorCode.UNAVAILABLE),  # our token, not the request
        (StatusError(500, b"boom"), WorkerUnavailable, ErrorCode.UNAVAILABLE),
        (ConnectError("refused"), WorkerUnavailable, ErrorCode.UNAVAILABLE),
        (DeadlineError("silent"), WorkerUnavailable, ErrorCode.TIMEOUT),
        (ProtocolError("dropped"), WorkerUnavailable, ErrorCode.UNAVAILABLE),
        (ValueError("not JSON"), WorkerUnavailable, ErrorCode.ENGINE_ERROR),
    ],
)
def test_error_for_keeps_the_workers_code(exc, cls, code):
    err = WorkerClient("http://127.0.0.1:1").error_for(exc)
    assert type(err) is cls and err.code is code and err.retryable == (cls is WorkerUnavailable)
    if exc.__class__ is StatusError and parse_error_body(exc.body) is not None:
        assert str(err) == "why"  # the worker's message, not the HTTP text around it
