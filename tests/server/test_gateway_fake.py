"""The gateway over the FAKE engine, through real HTTP (uvicorn in a thread) and the real SDKs.

Covers the request path end to end without a model: protocol shapes, usage arithmetic, stop
sequences and disconnects aborting the engine request, and every error status.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import anthropic
import httpx
import openai
import pytest

from deepserve.protocol import ErrorCode, GenerateRequest
from router.errors import NoWorkerAvailable, Overloaded, RequestRejected
from tests.server.conftest import MODEL
from tests.server.fake_engine import EOS, FakeEngine, text_script


def sse_events(text: str) -> list[tuple[str | None, str]]:
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((name, "\n".join(data)))
    return out


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


# ---- happy paths ----------------------------------------------------------------------------------
def test_chat_non_stream_usage_and_reasoning(make_gateway, catalog):
    engine = FakeEngine(text_script(catalog.tokenizer, "Let me see.</think>Hello there"), cached_tokens=3)
    gw = make_gateway(engine)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=7)
    msg = r.choices[0].message
    assert msg.content == "Hello there"
    assert msg.model_extra["reasoning_content"] == "Let me see."
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 3
    assert u.model_extra["prompt_cache_hit_tokens"] == 3
    assert u.model_extra["prompt_cache_miss_tokens"] == u.prompt_tokens - 3
    req: GenerateRequest = engine.requests[0]
    assert req.sampling.seed == 7 and EOS in req.sampling.stop_token_ids
    assert len(req.prompt_token_ids) == u.prompt_tokens
    assert req.request_id == r.id


def test_chat_stream_sdk(make_gateway, catalog):
    engine = FakeEngine(text_script(catalog.tokenizer, "Hi you"), cached_tokens=0)
    gw = make_gateway(engine)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}},
        logprobs=True, top_logprobs=2,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi you"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(lps) == 2 and all(len(lp.top_logprobs) == 2 for lp in lps)


def test_chat_stream_framing_and_done(gateway):
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    assert all(name is None for name, _ in events)
    for _, data in events[:-1]:
        assert json.loads(data)["object"] == "chat.completion.chunk"


def test_tool_call_parsed(make_gateway, catalog):
    dsml = (
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    engine = FakeEngine(text_script(catalog.tokenizer, dsml))
    gw = make_gateway(engine)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=tools,
        extra_body={"thinking": {"type": "disabled"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    constraint = engine.requests[0].sampling.constraint
    assert constraint is not None and constraint.kind == "tool_call" and constraint.trigger_token_ids == ()


def test_json_schema_constraint_after_thinking(make_gateway, catalog):
    engine = FakeEngine(text_script(catalog.tokenizer, '</think>{"a": 1}'))
    gw = make_gateway(engine)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "give json"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    })
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": 1}
    c = engine.requests[0].sampling.constraint
    assert c.kind == "json" and json.loads(c.spec) == schema
    assert c.trigger_token_ids == (catalog.thinking_end_id,)


def test_stop_sequence_aborts_engine(make_gateway, catalog):
    engine = FakeEngine(text_script(catalog.tokenizer, "one two STOP three four five six"), delay_s=0.01)
    gw = make_gateway(engine)
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["STOP"],
        "thinking": {"type": "disabled"},
    })
    body = r.json()
    assert body["choices"][0]["message"]["content"].strip() == "one two"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: engine.aborted == [body["id"]])


def test_client_disconnect_aborts_stream(make_gateway):
    engine = FakeEngine(list(range(1000, 1400)), delay_s=0.01)
    gw = make_gateway(engine)
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 400,
    }) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    assert wait_until(lambda: len(engine.aborted) == 1, 3.0)
    assert wait_until(lambda: not engine.active, 3.0)
    assert gw.state.admission.running == 0


def test_client_disconnect_aborts_non_stream(make_gateway):
    engine = FakeEngine(list(range(1000, 1400)), delay_s=0.01)
    gw = make_gateway(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 400,
        }, timeout=0.3)
    assert wait_until(lambda: len(engine.aborted) == 1, 3.0)
    assert wait_until(lambda: gw.state.admission.running == 0, 3.0)


def test_responses_and_stream_event_names(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none")
    r = client.responses.create(model=MODEL, input="hi")
    assert r.status == "completed" and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = [e.type for e in client.responses.create(model=MODEL, input="hi", stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"


def test_anthropic_messages(make_gateway, catalog):
    gw = make_gateway(FakeEngine(text_script(catalog.tokenizer, "hmm</think>Bonjour")))
    client = anthropic.Anthropic(base_url=gw.url, api_key="none")
    m = client.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "Bonjour"
    with client.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert final.content[-1].text == "Bonjour" and final.stop_reason == "end_turn"


def test_completions_token_ids_echo_logprobs(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none")
    r = client.completions.create(model=MODEL, prompt=[[100, 200, 300], [400, 500]], max_tokens=5, logprobs=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset)
        assert c.text.startswith("".join(lp.tokens[:2]))
    assert r.usage.prompt_tokens == 5 and r.usage.total_tokens == 5 + r.usage.completion_tokens


def test_completions_stream_stop_and_usage(make_gateway, catalog):
    engine = FakeEngine(text_script(catalog.tokenizer, "alpha beta gamma delta"))
    gw = make_gateway(engine)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    chunks = list(client.completions.create(model=MODEL, prompt="Say", stream=True, stop=" gamma", stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "alpha beta"
    assert chunks[-1].usage.completion_tokens >= 2
    assert engine.requests[0].prompt_token_ids[0] == gw.state.catalog.bos_token_id


def test_models(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none")
    assert {m.id for m in client.models.list()} == {MODEL, "tiny-v41"}
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("missing")


# ---- errors ---------------------------------------------------------------------------------------
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_auth(make_gateway):
    gw = make_gateway(api_keys=("sk-good",))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    _error(httpx.post(gw.url + "/v1/chat/completions", json=body), 401)
    assert _error(httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-bad"}), 401)["code"] == "invalid_api_key"
    assert httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-good"}).status_code == 200
    r = httpx.post(gw.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": []}, headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gw.url + "/health").status_code == 200  # probes need no key


def test_body_too_large_declared_and_streamed(make_gateway):
    gw = make_gateway(max_body_bytes=1000)
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert _error(httpx.post(gw.url + "/v1/chat/completions", json=big), 413)["code"] == "request_too_large"

    def chunks():
        for _ in range(100):
            yield b"x" * 100

    _error(httpx.post(gw.url + "/v1/chat/completions", content=chunks()), 413)


def test_body_timeout_408(make_gateway):
    gw = make_gateway(body_timeout_s=0.3)
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        s.settimeout(5)
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 408")


def test_validation_errors(gateway):
    url = gateway.url + "/v1/chat/completions"
    assert _error(httpx.post(url, content=b"{nope"), 400)["code"] == "invalid_json"
    _error(httpx.post(url, json=[1, 2]), 400)
    _error(httpx.post(url, json={"messages": []}), 400)
    assert _error(httpx.post(url, json={"model": "gpt-9", "messages": []}), 404)["code"] == "model_not_found"
    _error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9}), 400)
    _error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}), 400)
    _error(httpx.post(url, json={"model": MODEL, "messages": "nope"}), 400)
    _error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 5}), 400)
    comp = gateway.url + "/v1/completions"
    _error(httpx.post(comp, json={"model": MODEL, "prompt": [1, "a"]}), 400)
    _error(httpx.post(comp, json={"model": MODEL, "prompt": [10**9]}), 400)
    _error(httpx.post(comp, json={"model": MODEL, "prompt": "x", "n": 500}), 400)
    r = httpx.post(gateway.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_context_length(make_gateway):
    gw = make_gateway(max_model_len=64)
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]})
    assert _error(r, 400)["code"] == "context_length_exceeded"
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 10})
    assert _error(r, 400)["code"] == "context_length_exceeded"


def test_rate_limit_429(make_gateway):
    gw = make_gateway(rate_limit_rpm=2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    codes = [httpx.post(gw.url + "/v1/chat/completions", json=body).status_code for _ in range(2)]
    r = httpx.post(gw.url + "/v1/chat/completions", json=body)
    assert codes == [200, 200]
    _error(r, 429)
    assert int(r.headers["retry-after"]) >= 1


def test_overload_503(make_gateway):
    engine = FakeEngine(list(range(1000, 1100)), delay_s=0.02)
    gw = make_gateway(engine, max_concurrent_requests=1, max_queued_requests=0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "stream": True}

    async def go():
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", gw.url + "/v1/chat/completions", json=body) as first:
                assert first.status_code == 200
                second = await c.post(gw.url + "/v1/chat/completions", json=body)
                await first.aread()
            return second

    r = asyncio.run(go())
    _error(r, 503)
    assert r.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    "engine,status,code",
    [
        (FakeEngine(fail_with=NoWorkerAvailable("no workers")), 503, "unavailable"),
        (FakeEngine(fail_with=RequestRejected("bad ids")), 400, "invalid_request"),
        (FakeEngine(fail_with=RequestRejected("too long", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)), 400, "context_length_exceeded"),
        (FakeEngine(fail_with=NoWorkerAvailable("all full", code=ErrorCode.ENGINE_FULL)), 503, "engine_full"),
        (FakeEngine(error_after=0), 502, "engine_error"),
        (FakeEngine(error_after=0, error_code=ErrorCode.ENGINE_FULL), 503, "engine_full"),
        (FakeEngine(error_after=0, error_code=ErrorCode.INVALID_REQUEST), 400, "invalid_request"),
        (FakeEngine(fail_with=RuntimeError("boom")), 502, "engine_error"),
    ],
)
def test_engine_errors_before_first_token(make_gateway, engine, status, code):
    """The router's real exceptions and the engine's codes reach the client as their code's
    status and OpenAI ``code`` (a renamed class or code fails here)."""
    gw = make_gateway(engine)
    for stream in (False, True):
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream})
        assert _error(r, status)["code"] == code
        assert ("retry-after" in r.headers) == (status == 503)


def test_router_overload_keeps_retry_after(make_gateway):
    gw = make_gateway(FakeEngine(fail_with=Overloaded("queue full", retry_after=4.0)))
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert _error(r, 503)["code"] == "overloaded" and r.headers["retry-after"] == "4"


def test_engine_error_mid_stream_is_an_error_event(make_gateway):
    gw = make_gateway(FakeEngine(list(range(1000, 1010)), error_after=3))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))


def test_request_timeout_504(make_gateway):
    gw = make_gateway(FakeEngine(list(range(1000, 1100)), delay_s=0.05), request_timeout_s=0.3)
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 80})
    _error(r, 504)
    assert wait_until(lambda: len(gw.engine.aborted) == 1)


def test_internal_endpoints_not_exposed(gateway):
    for method, path in [("POST", "/internal/generate"), ("POST", "/internal/abort"), ("GET", "/load"), ("GET", "/kv_events")]:
        r = httpx.request(method, gateway.url + path, json={})
        assert r.status_code in (404, 405)
    assert not gateway.engine.requests


def test_metrics_count_requests(gateway):
    for _ in range(3):
        httpx.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True})
    httpx.post(gateway.url + "/v1/chat/completions", json={"model": "nope", "messages": []})
    text = httpx.get(gateway.url + "/metrics").text
    assert 'deepserve_http_requests_total{route="/v1/chat/completions",status="200"} 3.0' in text
    assert 'deepserve_http_rejected_total{reason="not_found"} 1.0' in text
    assert 'deepserve_http_streamed_tokens_total{route="/v1/chat/completions"} 9.0' in text
    assert 'deepserve_http_active_streams{route="/v1/chat/completions"} 0.0' in text
