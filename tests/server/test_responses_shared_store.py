"""Stored Responses in a real valkey server shared by two gateways (real HTTP, the openai SDK, the
FAKE engine): what one gateway stores the other reads, continues, deletes and cancels."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvstore.config import KVStoreConfig
from server.app import create_app
from server.config import GatewayConfig
from tests.server.conftest import MODEL, serve
from tests.server.fake_engine import FakeEngine, text_script

pytestmark = pytest.mark.redis
KEYS = ("sk-one", "sk-two")


@pytest.fixture
def pair(redis_server: Any, catalog: Any) -> Iterator[Any]:
    """``pair(**config)`` -> [(url, engine), (url, engine)]: two gateways on one Redis prefix."""
    stack = contextlib.ExitStack()
    prefix = f"test-shared-{uuid.uuid4().hex[:8]}"
    kv = KVStoreConfig(tiers=("memory",), redis_url=redis_server.url)

    def make(n: int = 2, engine: Any = None, **config: Any) -> list[tuple[str, FakeEngine]]:
        out = []
        for _ in range(n):
            eng = engine() if engine is not None else FakeEngine(text_script(catalog.tokenizer, "Hmm.</think>Hello there"))
            cfg = GatewayConfig(
                served_model_names=(MODEL,), api_keys=KEYS, responses_store="redis", responses_redis_prefix=prefix, **config
            )
            out.append((stack.enter_context(serve(create_app(cfg, eng, catalog=catalog, kv=kv))), eng))
        return out

    with stack:
        yield make


def _client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_one_gateway_stores_the_other_reads_continues_and_deletes(pair: Any) -> None:
    (url_a, _), (url_b, engine_b) = pair()
    a, b = _client(url_a), _client(url_b)
    first = a.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8)
    assert first.status == "completed" and first.output_text
    again = b.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text and again.store is True
    second = b.responses.create(model=MODEL, input="And again.", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    fresh_len = len(engine_b.requests[-1].prompt_token_ids)
    b.responses.create(model=MODEL, input="And again.", max_output_tokens=8, store=False)
    assert fresh_len > len(engine_b.requests[-1].prompt_token_ids)  # the chain's earlier turns were in the prompt
    items = a.responses.input_items.list(second.id, order="asc")
    texts = [getattr(p, "text", "") for item in items.data for p in (item.content or [])]
    assert texts[0] == "Say hello." and first.output_text in texts[1:-1] and texts[-1] == "And again."
    with pytest.raises(openai.NotFoundError):
        _client(url_a, KEYS[1]).responses.retrieve(first.id)  # another key's response: 404
    b.responses.delete(first.id)
    for client in (a, b):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(first.id)
        assert err.value.body["param"] is None and "not found" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        a.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"


def test_a_background_run_is_cancelled_through_the_other_gateway(pair: Any) -> None:
    (url_a, engine_a), (url_b, _) = pair(engine=lambda: FakeEngine(list(range(10, 400)), delay_s=0.02))
    a, b = _client(url_a), _client(url_b)
    r = a.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=300, background=True)
    assert r.status == "queued"
    deadline = time.time() + 10
    while b.responses.retrieve(r.id).status != "in_progress" and time.time() < deadline:
        time.sleep(0.05)
    assert b.responses.cancel(r.id).status == "cancelled"
    deadline = time.time() + 10
    while not engine_a.aborted and time.time() < deadline:  # A notices at its next look at the record
        time.sleep(0.05)
    assert engine_a.aborted, "the run on gateway A was not stopped"
    time.sleep(0.2)
    assert a.responses.retrieve(r.id).status == "cancelled"  # not overwritten by the stopped run


def test_records_expire_after_the_ttl_and_bad_ids_are_404(pair: Any) -> None:
    ((url, _),) = pair(1, responses_ttl_s=1.0)
    client = _client(url)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert client.responses.retrieve(r.id).id == r.id
    time.sleep(1.3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    for path in ("/v1/responses/resp_nope", "/v1/responses/" + "x" * 300):
        got = httpx.get(url + path, headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert got.status_code == 404 and got.json()["error"]["code"] == "not_found"
    got = httpx.delete(url + "/v1/responses/resp_nope", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert got.status_code == 404 and got.json()["error"]["type"] == "invalid_request_error"


def test_redis_down_answers_503_and_the_gateway_stays_up(catalog: Any) -> None:
    kv = KVStoreConfig(tiers=("redis",), redis_url="redis://127.0.0.1:9/0")  # nothing listens there
    cfg = GatewayConfig(served_model_names=(MODEL,))
    with serve(create_app(cfg, FakeEngine(), catalog=catalog, kv=kv)) as url:
        got = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4})
        assert got.status_code == 503 and got.json()["error"]["code"] == "response_store_unavailable"
        got = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4, "store": False})
        assert got.status_code == 200  # nothing to store: no store needed
