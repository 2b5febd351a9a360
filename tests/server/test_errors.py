"""Error mapping: recipe conversion errors, router/transport errors, OpenAI and Anthropic bodies."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from server.errors import (
    ContextLengthExceeded, EngineFailed, EngineTimeout, GatewayError, InvalidRequest, Overloaded, RateLimited,
    from_conversion_error, translate,
)


def _named(name: str, **attrs):
    return type(name, (Exception,), attrs)


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
    conv = dr.ChatCompletionRequest({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100}).convert(opts)
    with pytest.raises(dr.ConversionError) as info:
        conv.resolve_max_tokens(1000, 512)
    assert isinstance(from_conversion_error(info.value), ContextLengthExceeded)


@pytest.mark.parametrize(
    "exc,cls,status",
    [
        (_named("NoWorkerAvailable")("none"), Overloaded, 503),
        (_named("Overloaded", retry_after=3.0)("busy"), Overloaded, 503),
        (_named("RequestRejected", status=400)("bad"), InvalidRequest, 400),
        (_named("WorkerUnavailable", status=502)("gone"), EngineFailed, 502),
        (ConnectionRefusedError("refused"), Overloaded, 503),
        (TimeoutError("slow"), EngineTimeout, 504),
        (RuntimeError("boom"), EngineFailed, 502),
    ],
)
def test_translate(exc, cls, status):
    err = translate(exc)
    assert isinstance(err, cls) and err.status == status
    if status == 503:
        assert "Retry-After" in err.headers


def test_translate_router_errors_when_present():
    errors = pytest.importorskip("router.errors")
    assert translate(errors.Overloaded("full", retry_after=4.0)).headers == {"Retry-After": "4"}
    assert translate(errors.NoWorkerAvailable("none")).status == 503
    assert translate(errors.RequestRejected("bad")).status == 400
    assert translate(errors.WorkerRejected("bad")).status == 400


def test_reject_reasons():
    assert GatewayError("x", status=404).reject_reason == "not_found"
    assert GatewayError("x", status=400).reject_reason == "invalid_request"
    assert ContextLengthExceeded("x").reject_reason == "context_length"


def test_engine_text_is_never_passed_on_verbatim():
    leak = 'HTTP 400: {"error": "bad grammar at /build/xgrammar/cpp/parser.cc:88: unexpected )"}'
    err = translate(_named("RequestRejected", status=400)(leak))
    assert err.status == 400 and err.message == "bad grammar at <internal>: unexpected )"
    trace = "RuntimeError: boom\nTraceback (most recent call last):\n  File \"/srv/engine/runtime/engine_core.py\", line 9"
    for exc in (_named("WorkerUnavailable", status=502)(trace), RuntimeError(trace), TimeoutError(trace), ConnectionRefusedError(trace)):
        body = translate(exc).body().decode()
        assert "Traceback" not in body and ".py" not in body and "boom" not in body, body
    assert len(translate(_named("RequestRejected", status=400)("x" * 5000)).message) == 300


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_json_nested_too_deeply_is_a_400(gateway, path):
    import httpx

    deep = '{"model":"DeepSeek-V4-Pro","x":' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(gateway.url + path, content=deep, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.text and "Traceback" not in r.text
