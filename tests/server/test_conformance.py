"""API conformance over the FAKE engine (real HTTP, real openai / anthropic SDKs): every field is
honoured (it reaches the engine request, or shapes the answer) or refused with 400 and ``param``.

The observable sampling effects (a +100 logit_bias token appears, min_tokens delays EOS) need a
model: ``test_e2e_conformance.py`` checks them against a live stack.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from server import fields
from tests.server.conftest import MODEL
from tests.server.fake_engine import EOS, FakeEngine, text_script
from tests.server.test_gateway_fake import sse_events

USER = [{"role": "user", "content": "hi"}]
NO_THINK = {"thinking": {"type": "disabled"}}
DSML_TWO_CALLS = (
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">y</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]


def oai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def error_of(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def chat(gw, **body) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, **body}, timeout=30)


# ---- real bugs of issue 19 ------------------------------------------------------------------------
def test_one_long_token_id_prompt_is_one_prompt(gateway):
    r = oai(gateway).completions.create(model=MODEL, prompt=list(range(10, 110)), max_tokens=3)
    assert len(r.choices) == 1
    assert gateway.engine.requests[0].prompt_token_ids == list(range(10, 110))


def test_max_completion_tokens_is_the_limit(gateway):
    oai(gateway).chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=5, extra_body=NO_THINK)
    assert gateway.engine.requests[-1].sampling.max_tokens == 5
    chat(gateway, max_tokens=9, max_completion_tokens=4)  # both: max_completion_tokens wins (vLLM)
    assert gateway.engine.requests[-1].sampling.max_tokens == 4


def test_anthropic_max_tokens_required(gateway):
    r = httpx.post(gateway.url + "/v1/messages", json={"model": MODEL, "messages": USER})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    assert not gateway.engine.requests


def test_anthropic_system_role_in_messages_refused(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="system"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "system", "content": "x"}, *USER])


IMAGE_PNG = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": IMAGE_PNG}}]}]},
     "messages[0].content[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]},
     "messages[0].content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_PNG}]}]},
     "input[0].content[0]"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!not base64"}}]}]},
     "messages[0].content[0]"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]},
     "messages[0].content[0].content[0]"),
])
def test_media_inputs_refused_naming_the_part(gateway, route, body, param):
    r = httpx.post(gateway.url + route, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "not supported" in err["message"] and param in err["message"]
    if route != "/v1/messages":
        assert err["param"] == param
    assert not gateway.engine.requests


def test_developer_role_is_system(gateway):
    client = oai(gateway)
    client.chat.completions.create(model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, *USER], extra_body=NO_THINK)
    client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *USER], extra_body=NO_THINK)
    a, b = gateway.engine.requests
    assert a.prompt_token_ids == b.prompt_token_ids


# ---- the field policy -----------------------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": USER, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"messages": USER, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": USER, "audio": {"voice": "x"}}, "audio"),
    ("/v1/chat/completions", {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": USER, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": USER, "service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tools_in_user": True}}, "chat_template_kwargs.tools_in_user"),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ("/v1/responses", {"input": "x", "previous_response_id": 1}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "background": True, "store": False}, "background"),
    ("/v1/responses", {"input": "x", "store": "yes"}, "store"),
])
def test_unsupported_fields_refused_with_param(gateway, route, body, param):
    r = httpx.post(gateway.url + route, json={"model": MODEL, **body})
    error_of(r, param)
    assert not gateway.engine.requests


def test_openai_sdk_sees_the_refusal(gateway):
    with pytest.raises(openai.BadRequestError) as err:
        oai(gateway).chat.completions.create(model=MODEL, messages=USER, extra_body={"guided_frobnicate": "x"})
    assert err.value.body["param"] == "guided_frobnicate"


def test_harmless_and_null_fields_accepted(gateway):
    r = chat(gateway, store=False, metadata={"k": "v"}, user="u", service_tier="auto", functions=None, audio=None, **NO_THINK)
    assert r.status_code == 200, r.text
    assert gateway.engine.requests[-1].session_key == "u"


def test_every_accepted_field_is_documented():
    doc = (Path(__file__).parents[2] / "docs" / "API.md").read_text()
    sections = {route: doc.split(f"## `{route}`", 1)[1].split("\n## ", 1)[0] for route in fields.ENDPOINTS}
    for route, (accepted, off) in fields.ENDPOINTS.items():
        for name in [*accepted, *off]:
            assert f"`{name}`" in sections[route], f"{route}: {name} missing from docs/API.md"


# ---- honoured: reaches the engine request ---------------------------------------------------------
def test_sampling_extensions_reach_the_engine(gateway):
    r = chat(gateway, **NO_THINK, max_tokens=30, logit_bias={"42": 100}, min_tokens=3, stop_token_ids=[9], priority=-2,
             top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True)
    assert r.status_code == 200, r.text
    req = gateway.engine.requests[-1]
    s = req.sampling
    assert (s.logit_bias, s.min_tokens, s.stop_token_ids, s.ignore_eos) == (((42, 100.0),), 3, (9,), True)
    assert (s.top_k, s.min_p, s.repetition_penalty, req.priority) == (5, 0.1, 1.2, -2)
    comp = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "logit_bias": {"5": -100}, "min_tokens": 2})
    assert comp.status_code == 200, comp.text
    assert gateway.engine.requests[-1].sampling.logit_bias == ((5, -100.0),)


def test_thinking_mode_is_greedy_at_temperature_zero(gateway):
    chat(gateway, temperature=0)  # thinking mode by default
    assert gateway.engine.requests[-1].sampling.greedy


def test_chat_template_kwargs_select_thinking(gateway, catalog):
    gateway.engine.script = text_script(catalog.tokenizer, "plain answer")
    on = oai(gateway).chat.completions.create(model=MODEL, messages=USER, extra_body={"chat_template_kwargs": {"thinking": True}})
    off = oai(gateway).chat.completions.create(model=MODEL, messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on.choices[0].message.model_extra.get("reasoning_content") == "plain answer"
    assert off.choices[0].message.content == "plain answer" and off.choices[0].message.model_extra.get("reasoning_content") is None
    error_of(chat(gateway, chat_template_kwargs={"thinking": True}, thinking={"type": "disabled"}), "chat_template_kwargs")


def test_n_choices_are_seeded_streams_with_summed_usage(gateway):
    r = oai(gateway).chat.completions.create(model=MODEL, messages=USER, n=3, seed=40, extra_body=NO_THINK)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == "Hello world!" for c in r.choices)
    reqs = gateway.engine.requests
    assert [q.sampling.seed for q in reqs] == [40, 41, 42] and len({q.request_id for q in reqs}) == 3
    assert r.usage.prompt_tokens == len(reqs[0].prompt_token_ids)  # the prompt counted once
    assert r.usage.completion_tokens == 3 * 3  # "Hello world!" is 3 tokens, for each choice
    stream = list(oai(gateway).chat.completions.create(
        model=MODEL, messages=USER, n=2, stream=True, stream_options={"include_usage": True}, extra_body=NO_THINK))
    text = {0: "", 1: ""}
    for c in stream:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
    assert text == {0: "Hello world!", 1: "Hello world!"}
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 6


def test_completions_n_and_best_of(make_gateway):
    # the fake answers seed-dependent lengths: fewer tokens, higher summed logprob (-0.25 each)
    engine = FakeEngine(lambda req: [1000 + k for k in range(2 + (req.sampling.seed or 0) % 4)] + [EOS])
    gw = make_gateway(engine)
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "seed": 1, "max_tokens": 9}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert len(engine.requests) == 4 and [q.sampling.seed for q in engine.requests] == [1, 2, 1, 2]
    engine.requests.clear()
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "best_of": 3, "seed": 1, "max_tokens": 9}).json()
    assert len(engine.requests) == 3 and len(r["choices"]) == 1 and r["choices"][0]["logprobs"] is None
    best = min(engine.requests, key=lambda q: (q.sampling.seed or 0) % 4)  # the shortest answer
    assert r["choices"][0]["text"] == text_of(gw, engine.tokens_for(best))
    assert r["usage"]["completion_tokens"] == sum(1 + (q.sampling.seed or 0) % 4 + 1 for q in engine.requests)


def text_of(gw, ids: list[int]) -> str:
    tok = gw.state.catalog.tokenizer
    from server.decode import decode_tokens

    return decode_tokens(gw.state.catalog, [t for t in ids if t != EOS])[0] if tok else ""


def test_parallel_tool_calls_false_keeps_the_first(make_gateway, catalog):
    gw = make_gateway(FakeEngine(text_script(catalog.tokenizer, DSML_TWO_CALLS)))
    client = oai(gw)
    both = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, extra_body=NO_THINK)
    one = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=False, extra_body=NO_THINK)
    assert len(both.choices[0].message.tool_calls) == 2
    assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [{"a": "x"}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=False, stream=True, extra_body=NO_THINK))
    indexes = {tc.index for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or ())}
    assert indexes == {0}


def test_chat_echo_prepends_the_assistant_prefix(gateway):
    msgs = [*USER, {"role": "assistant", "content": "Sure: "}]
    r = chat(gateway, messages=msgs, echo=True, **NO_THINK).json()
    assert r["choices"][0]["message"]["content"] == "Sure: Hello world!"
    streamed = sse_events(chat(gateway, messages=msgs, echo=True, stream=True, **NO_THINK).text)
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for _, d in streamed[:-1])
    assert text == "Sure: Hello world!"


def test_skip_special_tokens(make_gateway, catalog):
    pad = 2  # <｜▁pad▁｜>, a special added token
    gw = make_gateway(FakeEngine([19923, pad, 2058, EOS]))
    r = chat(gw, **NO_THINK).json()
    assert r["choices"][0]["message"]["content"] == "Hello world"
    assert r["usage"]["completion_tokens"] == 3  # the skipped token was generated: counted (OpenAI, vLLM)
    r = chat(gw, skip_special_tokens=False, **NO_THINK).json()
    assert "<｜▁pad▁｜>" in r["choices"][0]["message"]["content"] and r["usage"]["completion_tokens"] == 3
    streamed = chunks_of(chat(gw, stream=True, stream_options={"include_usage": True}, **NO_THINK))
    assert streamed[-1]["usage"]["completion_tokens"] == 3
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed[:-1]) == "Hello world"


# ---- streamed usage by the spec -------------------------------------------------------------------
def chunks_of(r: httpx.Response) -> list[dict]:
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    return [json.loads(d) for _, d in events[:-1]]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": USER, **NO_THINK}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
])
def test_stream_usage_by_the_spec(gateway, route, body):
    url = gateway.url + route
    plain = chunks_of(httpx.post(url, json={"model": MODEL, "stream": True, **body}))
    assert all("usage" not in c for c in plain)
    usage = chunks_of(httpx.post(url, json={"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}))
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in usage[:-1])
    cont = chunks_of(httpx.post(url, json={
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **body}))
    counts = [c["usage"]["completion_tokens"] for c in cont]
    assert all(c["usage"]["prompt_tokens"] > 0 for c in cont) and counts == sorted(counts) and counts[-1] == 3


def test_sdk_stream_usage_chunk(gateway):
    stream = list(oai(gateway).chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}, extra_body=NO_THINK))
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == stream[-1].usage.prompt_tokens + 3
    assert all(c.usage is None for c in stream[:-1])


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": ["image_url"]}]}]}),
    ("/v1/chat/completions", {"messages": USER, "thinking": "on", "chat_template_kwargs": {"thinking": True}}),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": ["thinking"]}),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"1": None}}),
    ("/v1/chat/completions", {"messages": USER, "n": 1.5}),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}}),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": ["system"], "content": "x"}]}),
    ("/v1/messages", {"max_tokens": 5, "messages": USER, "system": [{"type": {"x": 1}}]}),
    ("/v1/completions", {"prompt": [[1, 2], "x"]}),
    ("/v1/completions", {"prompt": "x", "best_of": "3"}),
    ("/tokenize", {"messages": "x"}),
    ("/detokenize", {"tokens": "1 2"}),
])
def test_odd_types_are_400_not_500(gateway, route, body):
    r = httpx.post(gateway.url + route, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text


def test_responses_developer_role_is_system(gateway):
    client = oai(gateway)
    client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    client.responses.create(model=MODEL, input=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    a, b = gateway.engine.requests
    assert a.prompt_token_ids == b.prompt_token_ids


def test_n_beyond_the_concurrency_limit_refused(make_gateway):
    gw = make_gateway(max_concurrent_requests=2)
    error_of(chat(gw, n=3), "n")
    assert chat(gw, n=2, **NO_THINK).status_code == 200


def test_include_stop_str_in_output(gateway):
    plain = chat(gateway, stop=["wor"], **NO_THINK).json()["choices"][0]
    assert plain["message"]["content"] == "Hello " and plain["finish_reason"] == "stop"
    kept = chat(gateway, stop=["xyz", "wor"], include_stop_str_in_output=True, **NO_THINK).json()["choices"][0]
    assert kept["message"]["content"] == "Hello wor" and kept["finish_reason"] == "stop"
    streamed = chunks_of(chat(gateway, stop=["wor"], include_stop_str_in_output=True, stream=True, **NO_THINK))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == "Hello wor"
    url = gateway.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "stop": ["wor"], "include_stop_str_in_output": True}
    assert httpx.post(url, json=body).json()["choices"][0]["text"] == "Hello wor"
    streamed = chunks_of(httpx.post(url, json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == "Hello wor"
    eos = chat(gateway, stop=["nowhere"], include_stop_str_in_output=True, **NO_THINK).json()["choices"][0]
    assert eos["message"]["content"] == "Hello world!"  # ended by EOS: nothing added


def test_truncate_prompt_tokens_keeps_the_last_tokens(gateway):
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(10, 30)), "truncate_prompt_tokens": 5})
    assert r.status_code == 200 and gateway.engine.requests[-1].prompt_token_ids == list(range(25, 30))
    chat(gateway, **NO_THINK)
    whole = gateway.engine.requests[-1].prompt_token_ids
    chat(gateway, truncate_prompt_tokens=7, **NO_THINK)
    assert gateway.engine.requests[-1].prompt_token_ids == whole[-7:]
    error_of(chat(gateway, truncate_prompt_tokens=0), "truncate_prompt_tokens")
