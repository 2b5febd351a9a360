"""The early size check (server/size_check.py): its bound never exceeds a prompt's real token count
(the real DeepSeek tokenizer and deepseek-recipe rendering), a prompt that cannot fit is refused
without being tokenised, and one at the bound's edge that fits is served. Real HTTP on loopback."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from server.handler import convert_and_encode
from server.model import ModelCatalog, package_tokenizer_path
from server.routes import chat, messages, responses
from server.routes.completions import parse_completion
from server.size_check import COMPLETIONS, check_prompt_size, counted_chars, max_token_bytes
from tests.server.conftest import MODEL

SPACES, DOTS, CJK = " " * 3000, "." * 3000, "你好世界" * 400
PROTOS = {p.route: p for p in (chat.CHAT, responses.RESPONSES_PROTOCOL, messages.MESSAGES_PROTOCOL)}


def test_the_deepseek_tokenizers_longest_token_is_128_bytes() -> None:
    spec = json.loads(package_tokenizer_path().read_text())
    assert max_token_bytes(spec) == 128  # a run of 128 spaces (or dots); added tokens are at most 48


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "NFKC"}},
    {"model": {"type": "Unigram", "vocab": []}},
    {"added_tokens": [{"id": 1, "content": "<x>", "lstrip": True, "rstrip": False, "special": True}]},
])
def test_no_bound_where_it_would_not_be_sound(change: dict[str, Any]) -> None:
    spec = {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0}},
            "added_tokens": [], **change}
    assert max_token_bytes(spec) is None


BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SPACES}, {"role": "user", "content": DOTS}]}),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": SPACES}, {"type": "text", "text": CJK}]},
        {"role": "assistant", "content": "x", "reasoning_content": DOTS * 3},  # dropped from history: not counted
        {"role": "user", "content": "\n" * 2000},
    ]}),
    ("/v1/responses", {"input": SPACES + DOTS}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": DOTS}]}]}),
    ("/v1/messages", {"max_tokens": 4, "system": SPACES, "messages": [{"role": "user", "content": DOTS + CJK}]}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "\t" * 3000}]}]}),
]


@pytest.mark.parametrize("route,body", BODIES)
def test_the_bound_never_exceeds_the_rendered_prompts_tokens(catalog: ModelCatalog, route: str, body: dict[str, Any]) -> None:
    body = {"model": MODEL, **body}
    (_, chars), = counted_chars(body, route)
    _, _, prompt = convert_and_encode(_Gw(catalog), PROTOS[route], json.dumps(body).encode())
    assert chars > 0 and -(-chars // catalog.max_token_bytes) <= len(prompt)


def test_the_bound_never_exceeds_a_completion_prompts_tokens(catalog: ModelCatalog) -> None:
    body = {"model": MODEL, "prompt": [SPACES, DOTS, CJK, "a" * 3000]}
    parsed = parse_completion(body, catalog)
    for (param, chars), (ids, _) in zip(counted_chars(body, COMPLETIONS), parsed.prompts):
        assert param == "prompt" and -(-chars // catalog.max_token_bytes) <= len(ids)


def test_truncation_asked_turns_the_check_off() -> None:
    huge = {"messages": [{"role": "user", "content": "." * 10_000}]}
    with pytest.raises(Exception, match="at least 79 tokens"):
        check_prompt_size(huge, "/v1/chat/completions", 64, 128)
    check_prompt_size({**huge, "truncate_prompt_tokens": 16}, "/v1/chat/completions", 64, 128)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": ["user"], "content": [{"type": ["text"], "text": 1}, 3, None]}, "x"]},
    {"messages": {"role": "user"}, "input": 7, "system": [[]], "prompt": [["a"], 5]},
])
def test_odd_shapes_are_left_to_the_validation_after_it(body: dict[str, Any]) -> None:
    for route in PROTOS.keys() | {COMPLETIONS}:
        check_prompt_size(body, route, 2, 128)


class _Gw:
    def __init__(self, catalog: ModelCatalog) -> None:
        self.catalog = catalog


def test_a_many_megabyte_message_is_refused_untokenised_while_health_answers(make_gateway: Any) -> None:
    gw = make_gateway(max_model_len=4096)  # refused from 4096 * 128 = 524,288 characters
    huge = "lorem ipsum dolor sit amet " * 250_000  # 6.75M characters: seconds to tokenise
    result: dict[str, Any] = {}

    def send() -> None:
        result["r"] = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                                 json={"model": MODEL, "messages": [{"role": "user", "content": huge}]})

    thread = threading.Thread(target=send)
    thread.start()
    health = []
    while thread.is_alive():
        health.append(httpx.get(gw.url + "/health", timeout=10).status_code)
    thread.join()
    r = result["r"]
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "characters, which is at least 52735 tokens" in error["message"]  # the early check, not the tokenizer's count
    assert health and set(health) == {200}
    assert gw.engine.requests == []

    r = httpx.post(gw.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": ["hi", huge], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "characters" in r.json()["error"]["message"]


def test_a_prompt_at_the_bounds_edge_that_fits_is_served(make_gateway: Any) -> None:
    gw = make_gateway(max_model_len=4096)
    edge = "." * (128 * 4000)  # 4,000 tokens of 128 dots: under the context, so it must pass
    r = httpx.post(gw.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": edge, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(gw.engine.requests[-1].prompt_token_ids) == 4001  # BOS + 4,000
