"""Error mapping: recipe conversion errors, error codes, router/transport errors, OpenAI and Anthropic bodies."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from deepserve.protocol import ErrorCode
from router import errors as router_errors
from server.errors import (
    ContextLengthExceeded, EngineFailed, EngineTimeout, GatewayError, InvalidRequest, NotFound, Overloaded, RateLimited,
    from_code, from_conversion_error, translate,
)


def test_bodies_and_headers():
    err = RateLimited("slow down", type="requests", retry_after=1.2)
    assert json.loads(err.body()) == {"error": {"message": "slow down", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    assert err.headers == {"Retry-After": "2"}
    assert json.loads(err.body("anthropic")) == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert json.loads(Overloaded("busy").body("anthropic"))["error"]["type"] == "overloaded_error"
    assert InvalidRequest("x").headers == {}


def test_conversion_errors_keep_recipe_body():
    opts = dr.ConversionOptions().with_model_versions_by_name({"m": dr.ModelVersion.DeepseekV4Pro})
    with pytest.raises(dr.ConversionError) as info:
        dr.ChatCompletionRequest({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 7}).convert(opts)
    err = from_conversion_error(info.value)
    assert err.status == 400 and err.type == "invalid_request_error" and "temperature" in err.message


@pytest.mark.parametrize(
    "code,cls",
    [
        (ErrorCode.INVALID_REQUEST, InvalidRequest),
        (ErrorCode.CONTEXT_LENGTH_EXCEEDED, ContextLengthExceeded),
        (ErrorCode.NOT_FOUND, NotFound),
        (ErrorCode.PERMISSION_DENIED, GatewayError),
        (ErrorCode.ENGINE_FULL, Overloaded),
        (ErrorCode.OVERLOADED, Overloaded),
        (ErrorCode.UNAVAILABLE, Overloaded),
        (ErrorCode.CANCELLED, Overloaded),
        (ErrorCode.TIMEOUT, EngineTimeout),
        (ErrorCode.ENGINE_ERROR, EngineFailed),
        (ErrorCode.INTERNAL, GatewayError),
    ],
)
def test_from_code(code, cls):
    """Every code maps to its status, OpenAI type and code; only client faults keep the text."""
    err = from_code(code, "detail at /srv/engine/x.py:3")
    assert type(err) is cls and (err.status, err.type, err.code) == (code.status, code.openai_type, code.value)
    assert json.loads(err.body())["error"]["code"] == code.value
    assert ("detail at <internal>" == err.message) == code.client_fault
    assert ("Retry-After" in err.headers) == (code.status == 503)


def test_from_code_covers_every_code():
    assert {from_code(code, "x").code for code in ErrorCode} == {code.value for code in ErrorCode}
    assert from_code(ErrorCode.OVERLOADED, "x", retry_after=4.0).headers == {"Retry-After": "4"}


@pytest.mark.parametrize(
    "exc,code",
    [
        (router_errors.NoWorkerAvailable("none"), ErrorCode.UNAVAILABLE),
        (router_errors.NoWorkerAvailable("all full", code=ErrorCode.ENGINE_FULL), ErrorCode.ENGINE_FULL),
        (router_errors.Overloaded("busy"), ErrorCode.OVERLOADED),
        (router_errors.RequestRejected("bad"), ErrorCode.INVALID_REQUEST),
        (router_errors.WorkerRejected("long", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED), ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        (router_errors.WorkerUnavailable("gone"), ErrorCode.UNAVAILABLE),
        (router_errors.WorkerUnavailable("cut", code=ErrorCode.ENGINE_ERROR), ErrorCode.ENGINE_ERROR),
        (ConnectionRefusedError("refused"), ErrorCode.UNAVAILABLE),
        (TimeoutError("slow"), ErrorCode.TIMEOUT),
        (RuntimeError("boom"), ErrorCode.ENGINE_ERROR),
    ],
)
def test_translate(exc, code):
    err = translate(exc)
    assert err.code == code.value and err.status == code.status


def test_translate_keeps_router_retry_after():
    assert translate(router_errors.Overloaded("full", retry_after=4.0)).headers == {"Retry-After": "4"}


def test_reject_reasons():
    assert GatewayError("x", status=404).reject_reason == "not_found"
    assert GatewayError("x", status=400).reject_reason == "invalid_request"
    assert ContextLengthExceeded("x").reject_reason == "context_length"


def test_engine_text_is_never_passed_on_verbatim():
    err = translate(router_errors.RequestRejected("bad grammar at /build/xgrammar/cpp/parser.cc:88: unexpected )"))
    assert err.status == 400 and err.message == "bad grammar at <internal>: unexpected )"
    trace = "RuntimeError: boom\nTraceback (most recent call last):\n  File \"/srv/engine/runtime/engine_core.py\", line 9"
    for exc in (router_errors.WorkerUnavailable(trace), RuntimeError(trace), TimeoutError(trace), ConnectionRefusedError(trace)):
        body = translate(exc).body().decode()
        assert "Traceback" not in body and ".py" not in body and "boom" not in body, body
    assert len(translate(router_errors.RequestRejected("x" * 5000)).message) == 300


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_json_nested_too_deeply_is_a_400(gateway, path):
    import httpx

    deep = '{"model":"DeepSeek-V4-Pro","x":' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(gateway.url + path, content=deep, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.text and "Traceback" not in r.text
