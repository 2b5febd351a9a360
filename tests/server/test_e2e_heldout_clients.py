"""Requests no earlier test sent, through the real `openai` / `anthropic` SDKs and raw HTTP, over
one gateway (FAKE engine, real recipe conversion, real HTTP on loopback) for the module.

Each was a bug: a 500 for an integer beyond 64 bits, a refusal that named no field (the recipe's
serde text ``invalid type: string "yes", expected a boolean``), fields accepted and dropped
(a message ``name``, Responses ``text.verbosity``, a non-string ``user``, a non-object
``metadata``, Anthropic ``metadata`` keys other than ``user_id``), an Anthropic ``temperature``
above Anthropic's 1.0, a forced ``tool_choice`` without ``tools`` (answered in plain text).
"""

from __future__ import annotations

from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from server.app import create_app
from server.config import GatewayConfig
from tests.server.conftest import MODEL, serve
from tests.server.fake_engine import FakeEngine

USER = [{"role": "user", "content": "hi"}]
NO_THINK = {"thinking": {"type": "disabled"}}
HUGE = 2**70


class _Gateway:
    def __init__(self, url: str, engine: FakeEngine) -> None:
        self.url, self.engine = url, engine


@pytest.fixture(scope="module")
def gw(catalog) -> Iterator[_Gateway]:
    engine = FakeEngine()
    app = create_app(GatewayConfig(served_model_names=(MODEL, "tiny-v41=v4")), engine, catalog=catalog)
    with serve(app) as url:
        yield _Gateway(url, engine)


def post(gw: _Gateway, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + route, json={"model": MODEL, **body}, timeout=30)


def refused(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    return err


# ---- an integer beyond 64 bits is a 400 naming it, not a 500 ----------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": USER, "seed": HUGE}, "seed"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": HUGE}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": HUGE, "store": False}, "max_output_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": -HUGE, "logprobs": True}, "top_logprobs"),
])
def test_huge_integers_are_400_naming_the_field(gw, route, body, param):
    refused(post(gw, route, body), param)
    assert post(gw, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **NO_THINK}).status_code == 200


def test_anthropic_huge_max_tokens_names_it(gw):
    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=HUGE, messages=USER, timeout=30)
    assert err.value.body["type"] == "error" and "max_tokens" in err.value.body["error"]["message"]


# ---- the recipe's refusals name the field -------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": USER, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": USER, "stop": 5}, "stop"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "seed": "x"}, "seed"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"messages": USER, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "bogus"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "bogus"}}, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "web_search"}]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "bogus", "content": "x"}]}, "messages[1].role"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "user", "content": 5}]}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f"}}]}, "messages[1].tool_calls[0]"),
    ("/v1/responses", {"input": "hi", "temperature": "hot", "store": False}, "temperature"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0, "store": False}, "max_output_tokens"),
    ("/tokenize", {"messages": [{"role": "bogus", "content": "x"}]}, "messages[0].role"),
])
def test_recipe_refusals_name_the_field(gw, route, body, param):
    refused(post(gw, route, body), param)


def test_openai_sdk_sees_the_named_field(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, stop=5)  # type: ignore[arg-type]
    assert err.value.param == "stop"


@pytest.mark.parametrize("body,field", [
    ({"stop_sequences": "a"}, "stop_sequences"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}, *USER]}, "messages[1].content[0]"),
    ({"temperature": 1.5}, "temperature"),
    ({"metadata": {"session": "x"}}, "metadata.session"),
])
def test_anthropic_refusals_name_the_field(gw, body, field):
    r = httpx.post(gw.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": USER, **body})
    assert r.status_code == 400, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"].startswith(field) or f"'{field}'" in payload["error"]["message"], payload


def test_count_tokens_refusal_names_the_field(gw):
    r = httpx.post(gw.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages"), r.text


# ---- fields nothing renders are refused, not dropped ----------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "frobnicate": 1}]}, "messages[0].frobnicate"),
    ("/v1/chat/completions", {"messages": USER, "user": 5}, "user"),
    ("/v1/chat/completions", {"messages": USER, "metadata": "x"}, "metadata"),
    ("/v1/chat/completions", {"messages": USER, "metadata": {"k": 5}}, "metadata.k"),
    ("/v1/chat/completions", {"messages": USER, "verbosity": "low"}, "verbosity"),
    ("/v1/responses", {"input": "hi", "text": {"verbosity": "low"}, "store": False}, "text.verbosity"),
    ("/v1/responses", {"input": "hi", "text": {"frobnicate": 1}, "store": False}, "text.frobnicate"),
])
def test_unrendered_fields_are_refused(gw, route, body, param):
    before = len(gw.engine.requests)
    refused(post(gw, route, body), param)
    assert len(gw.engine.requests) == before


def test_default_and_null_values_still_pass(gw):
    """What SDKs send back from an earlier answer (nulls) and OpenAI's defaults stay accepted."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    history = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "yo", "refusal": None, "audio": None, "function_call": None, "tool_calls": None, "annotations": []},
        {"role": "user", "content": "again"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, verbosity="medium", metadata={"k": "v"}, user="u",  # type: ignore[arg-type]
                                       extra_body=NO_THINK)
    assert r.choices[0].message.content
    resp = client.responses.create(model=MODEL, input="hi", text={"verbosity": "medium"}, store=False)
    assert resp.output
    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    msg = claude.messages.create(model=MODEL, max_tokens=5, messages=USER, metadata={"user_id": "u"},
                                 extra_body={"temperature": 1.0})
    assert msg.content


# ---- a forced tool choice needs tools --------------------------------------------------------------
F = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": []}),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/responses", {"input": "hi", "tool_choice": "required", "store": False}),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "f"}, "store": False}),
])
def test_forced_tool_choice_without_tools_is_refused(gw, route, body):
    before = len(gw.engine.requests)
    refused(post(gw, route, body), "tool_choice")
    assert len(gw.engine.requests) == before


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "f"}])
def test_anthropic_forced_tool_choice_without_tools_is_refused(gw, choice):
    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=5, messages=USER, tool_choice=choice)  # type: ignore[arg-type]
    assert "tool_choice" in err.value.body["error"]["message"]


def test_auto_and_none_without_tools_still_pass(gw):
    assert post(gw, "/v1/chat/completions", {"messages": USER, "tool_choice": "auto", **NO_THINK}).status_code == 200
    assert post(gw, "/v1/chat/completions", {"messages": USER, "tool_choice": "none", **NO_THINK}).status_code == 200


def test_unknown_named_tool_names_tool_choice(gw):
    refused(post(gw, "/v1/chat/completions", {"messages": USER, "tools": F, "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice")


# ---- Anthropic tool_result is_error reaches the prompt -------------------------------------------------
A_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def _tool_turn(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", **result}]},
    ]


def test_anthropic_tool_result_is_error_is_rendered(gw):
    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)

    def prompt(result: dict[str, Any]) -> list[int]:
        claude.messages.create(model=MODEL, max_tokens=2, messages=_tool_turn(result), tools=A_TOOLS, thinking={"type": "disabled"})  # type: ignore[arg-type]
        return gw.engine.requests[-1].prompt_token_ids

    ok = prompt({"content": "timeout"})
    failed = prompt({"content": "timeout", "is_error": True})
    assert failed != ok
    assert failed == prompt({"content": "[tool error] timeout"})
    assert prompt({"content": [{"type": "text", "text": "timeout"}], "is_error": True}) != prompt({"content": [{"type": "text", "text": "timeout"}]})
    assert prompt({"content": "timeout", "is_error": False}) == ok


def test_completions_client_keys_are_typed(gw):
    refused(post(gw, "/v1/completions", {"prompt": "x", "user": 5}), "user")
    refused(post(gw, "/v1/completions", {"prompt": "x", "metadata": "x"}), "metadata")


# ---- Anthropic disable_parallel_tool_use keeps one tool_use --------------------------------------------
DSML_TWO_CALLS = (
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">y</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
F_TOOL = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}]


@pytest.fixture
def two_calls(gw, catalog) -> Iterator[None]:
    from tests.server.fake_engine import text_script

    saved = gw.engine.script
    gw.engine.script = text_script(catalog.tokenizer, "Let me check." + DSML_TWO_CALLS)
    yield
    gw.engine.script = saved


@pytest.mark.parametrize("disable", [False, True])
def test_anthropic_disable_parallel_tool_use(gw, two_calls, disable):
    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    kwargs: dict[str, Any] = dict(
        model=MODEL, max_tokens=200, messages=USER, tools=F_TOOL, thinking={"type": "disabled"},
        tool_choice={"type": "auto", "disable_parallel_tool_use": disable},
    )
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [e for e in stream]
        streamed = stream.get_final_message()
    calls = 1 if disable else 2
    for message in (whole, streamed):
        uses = [b for b in message.content if b.type == "tool_use"]
        assert [u.input for u in uses] == [{"a": "x"}, {"a": "y"}][:calls]
        assert message.stop_reason == "tool_use"
        assert message.content[0].type == "text"
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(starts))) and len(starts) == 1 + calls


def test_responses_message_item_fields_and_named_tool(gw):
    refused(post(gw, "/v1/responses", {"input": [{"role": "user", "content": "x", "name": "bob"}], "store": False}), "input[0].name")
    earlier = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "phase": "final_answer",
               "content": [{"type": "output_text", "text": "yo", "annotations": []}]}
    r = post(gw, "/v1/responses", {"input": [{"role": "user", "content": "hi"}, earlier, {"role": "user", "content": "x"}], "store": False})
    assert r.status_code == 200, r.text
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    refused(post(gw, "/v1/responses", {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "nope"}, "store": False}), "tool_choice")


# ---- Responses parallel_tool_calls: false (Codex CLI sends it) keeps one function call -----------------
@pytest.mark.parametrize("parallel", [True, False])
def test_responses_parallel_tool_calls(gw, two_calls, parallel):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}]
    kwargs: dict[str, Any] = dict(model=MODEL, input="hi", tools=tools, parallel_tool_calls=parallel, reasoning={"effort": "none"})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = [e for e in stream]
        streamed = stream.get_final_response()
    calls = 2 if parallel else 1
    for response in (whole, streamed):
        assert [o.arguments for o in response.output if o.type == "function_call"] == ['{"a": "x"}', '{"a": "y"}'][:calls]
        assert response.parallel_tool_calls is parallel
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == list(range(len(added))) and len(added) == len(streamed.output)
    stored = client.responses.retrieve(whole.id)
    assert len([o for o in stored.output if o.type == "function_call"]) == calls


# ---- Anthropic prefill: the answer continues the final assistant turn ------------------------------
def test_anthropic_prefill_is_continued(gw, catalog):
    from server.decode import decode_tokens

    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    for messages in (turns, [turns[0], {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]):
        msg = claude.messages.create(model=MODEL, max_tokens=5, messages=messages)  # type: ignore[arg-type]
        prompt = decode_tokens(catalog, gw.engine.requests[-1].prompt_token_ids)[0]
        assert prompt.endswith("The answer is"), prompt
        assert [b.type for b in msg.content] == ["text"]
        assert claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens == len(gw.engine.requests[-1].prompt_token_ids)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=2000, messages=turns, thinking={"type": "enabled", "budget_tokens": 1024})  # type: ignore[arg-type]
    assert "messages[1]" in err.value.body["error"]["message"]
    claude.messages.create(model=MODEL, max_tokens=5, messages=[*turns, {"role": "user", "content": "more"}])  # type: ignore[arg-type]
    assert not decode_tokens(catalog, gw.engine.requests[-1].prompt_token_ids)[0].endswith("more")  # a later user turn: a normal answer


def test_responses_item_reference_is_refused(gw):
    body = {"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}], "store": False}
    refused(post(gw, "/v1/responses", body), "input[1]")


def test_responses_context_overflow_names_input(gw):
    r = post(gw, "/v1/responses", {"input": "hello " * 70000, "max_output_tokens": 5, "store": False})
    assert refused(r, "input")["code"] == "context_length_exceeded"


def test_responses_include_encrypted_reasoning_is_accepted(gw, catalog):
    """Codex CLI sends include: ["reasoning.encrypted_content"] with store: false; reasoning items
    always carry encrypted_content, so the request is served as asked."""
    from tests.server.fake_engine import text_script

    saved = gw.engine.script
    gw.engine.script = text_script(catalog.tokenizer, "I think</think>Answer")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        r = client.responses.create(model=MODEL, input="hi", store=False, include=["reasoning.encrypted_content"])
        assert [o.encrypted_content for o in r.output if o.type == "reasoning"][0]
    finally:
        gw.engine.script = saved
    refused(post(gw, "/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs"], "store": False}), "include")


# ---- negative seeds (OpenAI takes any int64; UIs send -1) are honoured, not refused -----------------
def test_negative_seeds_are_distinct_deterministic_streams(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    seeds = []
    for seed in (-1, -2, -1, -(1 << 63)):
        before = len(gw.engine.requests)
        client.chat.completions.create(model=MODEL, messages=USER, seed=seed, max_tokens=2, extra_body=NO_THINK)
        (req,) = gw.engine.requests[before:]
        seeds.append(req.sampling.seed)
    assert seeds == [(1 << 63) - 1, (1 << 63) - 2, (1 << 63) - 1, 0]  # seed mod 2^63: the same seed, the same stream
    before = len(gw.engine.requests)
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "a", "seed": -2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert gw.engine.requests[before].sampling.seed == seeds[1]  # Completions maps it the same way
    refused(post(gw, "/v1/completions", {"model": MODEL, "prompt": "a", "seed": -(1 << 63) - 1, "max_tokens": 2}), "seed")
