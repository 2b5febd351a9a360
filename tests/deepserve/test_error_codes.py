"""deepserve.protocol.errors: each code's status and type, the HTTP error body, the event field."""

from __future__ import annotations

import json

import pytest

from deepserve.protocol import CodedError, ErrorCode, TokenEvent, WireError, error_body, parse_error_body


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_body_round_trip(code):
    body = json.dumps(error_body(code, "why")).encode()
    assert parse_error_body(body) == WireError(code, "why")
    assert json.loads(body)["error"]["type"] == code.openai_type


def test_statuses_and_fault():
    assert {c: c.status for c in ErrorCode if c.client_fault} == {
        ErrorCode.INVALID_REQUEST: 400, ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.PERMISSION_DENIED: 403,
    }
    assert {c.status for c in (ErrorCode.ENGINE_FULL, ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED)} == {503}
    assert (ErrorCode.TIMEOUT.status, ErrorCode.ENGINE_ERROR.status, ErrorCode.INTERNAL.status) == (504, 502, 500)


@pytest.mark.parametrize(
    "body", [b"not json", b'{"error": "text only"}', b'{"error": {"message": "x", "code": "no_such_code"}}', b"[]"]
)
def test_parse_error_body_refuses_what_is_not_one(body):
    assert parse_error_body(body) is None


def test_token_event_carries_the_code():
    ev = TokenEvent("r", finish_reason="error", error="queue full", error_code=ErrorCode.ENGINE_FULL)
    wire = json.loads(json.dumps(ev.to_dict()))
    assert wire["error_code"] == "engine_full"
    assert TokenEvent.from_dict(wire).error_code is ErrorCode.ENGINE_FULL
    assert "error_code" not in TokenEvent("r", [1]).to_dict() and TokenEvent.from_dict({"request_id": "r"}).error_code is None


def test_coded_error_code_per_class_or_instance():
    class Full(CodedError):
        code = ErrorCode.ENGINE_FULL

    assert Full("x").code is ErrorCode.ENGINE_FULL and Full("x").retry_after is None
    err = Full("x", code=ErrorCode.UNAVAILABLE, retry_after=2.0)
    assert (err.code, err.retry_after, str(err)) == (ErrorCode.UNAVAILABLE, 2.0, "x")
