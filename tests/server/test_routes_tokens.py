"""Token endpoints, model cards, /ping, /version and X-Request-Id over the FAKE engine (real HTTP)."""

from __future__ import annotations

import anthropic
import httpx
import openai

from tests.server.conftest import MODEL

USER = [{"role": "user", "content": "hi there"}]


def test_tokenize_prompt_and_detokenize(gateway, catalog):
    r = httpx.post(gateway.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    ids = [catalog.bos_token_id, *catalog.tokenizer.encode("hello world")]
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == catalog.context_len
    assert "".join(r["token_strs"][1:]) == "hello world"
    bare = httpx.post(gateway.url + "/tokenize", json={"model": MODEL, "prompt": "hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:] and bare["token_strs"] is None
    back = httpx.post(gateway.url + "/detokenize", json={"tokens": ids[1:]}).json()
    assert back == {"prompt": "hello world"}
    assert httpx.post(gateway.url + "/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "tokens"
    assert httpx.post(gateway.url + "/tokenize", json={"prompt": "x", "bogus": 1}).json()["error"]["param"] == "bogus"


def test_chat_tokenize_and_render_match_what_the_engine_gets(gateway):
    body = {"model": MODEL, "messages": USER, "thinking": {"type": "disabled"}}
    httpx.post(gateway.url + "/v1/chat/completions", json=body)
    engine_prompt = gateway.engine.requests[-1].prompt_token_ids
    tok = httpx.post(gateway.url + "/tokenize", json=body).json()
    assert tok["tokens"] == engine_prompt
    render = httpx.post(gateway.url + "/v1/chat/completions/render", json=body).json()
    assert render["prompt_token_ids"] == engine_prompt and "hi there" in render["prompt"]
    assert len(gateway.engine.requests) == 1  # neither generates


def test_tokenize_takes_a_strict_schema_the_recipe_refuses_as_chat_does(gateway):
    """A strict response schema deepseek-recipe's own strict rewrite refuses (an enum without a
    type) is answered by chat; /tokenize and render give the very prompt the engine got."""
    schema = {"type": "object", "properties": {"c": {"enum": ["red", 1]}}, "required": ["c"], "additionalProperties": False}
    body = {"model": MODEL, "messages": USER, "thinking": {"type": "disabled"},
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": schema}}}  # fmt: skip
    assert httpx.post(gateway.url + "/v1/chat/completions", json=body).status_code == 200
    engine_prompt = gateway.engine.requests[-1].prompt_token_ids
    assert httpx.post(gateway.url + "/tokenize", json=body).json()["tokens"] == engine_prompt
    assert httpx.post(gateway.url + "/v1/chat/completions/render", json=body).json()["prompt_token_ids"] == engine_prompt


def test_anthropic_count_tokens(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0)
    client.messages.create(model=MODEL, max_tokens=5, messages=USER, system="Be brief.")
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    assert counted.input_tokens == len(gateway.engine.requests[-1].prompt_token_ids)


def test_model_card_ping_version(gateway, catalog):
    card = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none").models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == catalog.context_len and card.model_extra["root"]
    listed = httpx.get(gateway.url + "/v1/models").json()["data"]
    assert all(m["max_model_len"] == catalog.context_len for m in listed)
    assert httpx.get(gateway.url + "/ping").status_code == 200 and httpx.post(gateway.url + "/ping").status_code == 200
    assert httpx.get(gateway.url + "/version").json()["version"]


def test_x_request_id_read_echoed_and_carried(gateway):
    body = {"model": MODEL, "messages": USER}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"
    assert gateway.engine.requests[-1].request_id.startswith("chatcmpl-trace-42-")
    again = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert again.status_code == 200  # a reused id still gets a distinct engine request
    made = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert made.json()["id"] == "cmpl-" + made.headers["x-request-id"]
    err = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "nope", "messages": USER}, headers={"X-Request-Id": "e1"})
    assert err.status_code == 404 and err.headers["x-request-id"] == "e1"
