"""Stateful Responses end to end: the real `openai` SDK against the live `deepserve up` stack
(a real worker): store, GET / DELETE, previous_response_id, background with polling and cancel."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server.conftest import E2E_KEY, E2E_LIMITED_KEY, E2E_MODEL, engine_missing_reason

pytestmark = pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or "")

@pytest.fixture(scope="module")
def client(live_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_KEY, max_retries=0, timeout=120)


def _poll(client: openai.OpenAI, rid: str, until: tuple[str, ...], timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status in until or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_stored_response_is_retrieved_and_deleted(client) -> None:
    r = client.responses.create(model=E2E_MODEL, input="Say hi.", max_output_tokens=8, temperature=0)
    assert r.store is True and r.status in ("completed", "incomplete")
    got = client.responses.retrieve(r.id)
    assert (got.id, got.status, got.output_text, got.usage.output_tokens) == (r.id, r.status, r.output_text, r.usage.output_tokens)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert err.value.body["type"] == "invalid_request_error" and r.id in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_previous_response_id_continues_the_stored_conversation(client) -> None:
    """A continuation equals the stateless request that sends the whole history itself (same
    prompt tokens, same greedy answer); the first request's instructions are not carried over."""
    first = client.responses.create(model=E2E_MODEL, input="Name a colour.", instructions="Be brief.", max_output_tokens=6, temperature=0)
    follow = client.responses.create(model=E2E_MODEL, input="And another?", previous_response_id=first.id, max_output_tokens=6, temperature=0)
    assert follow.previous_response_id == first.id
    history = [{"role": "user", "content": "Name a colour."}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "And another?"}]
    explicit = client.responses.create(model=E2E_MODEL, input=history, max_output_tokens=6, temperature=0, store=False)
    alone = client.responses.create(model=E2E_MODEL, input="And another?", max_output_tokens=1, store=False)
    assert follow.usage.input_tokens == explicit.usage.input_tokens > alone.usage.input_tokens
    assert follow.output_text == explicit.output_text
    listed = client.responses.input_items.list(follow.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "user"), *[(item.type, getattr(item, "role", None)) for item in first.output], ("message", "user")]
    assert listed.data[0].content[0].text == "Name a colour." and all(item.id for item in listed.data)
    newest = client.responses.input_items.list(follow.id, limit=1)  # desc by default
    assert newest.has_more and newest.data[0].content[0].text == "And another?"


def test_unstored_unknown_and_foreign_ids_are_404(client, live_stack) -> None:
    r = client.responses.create(model=E2E_MODEL, input="x", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=E2E_MODEL, input="x", max_output_tokens=2, previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    mine = client.responses.create(model=E2E_MODEL, input="x", max_output_tokens=2)
    other = openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_LIMITED_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)


def test_background_response_is_polled_to_completion(client) -> None:
    r = client.responses.create(model=E2E_MODEL, input="Count.", max_output_tokens=8, background=True, temperature=0)
    assert r.background is True and r.status == "queued" and r.output == []
    done = _poll(client, r.id, ("completed", "incomplete", "failed"))
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(client.responses.create(model=E2E_MODEL, input="x", max_output_tokens=2).id)
    assert client.responses.cancel(r.id).status == done.status  # finished: returned as it is


def test_background_response_is_cancelled(client) -> None:
    r = client.responses.create(model=E2E_MODEL, input="Write a long story.", max_output_tokens=1500, background=True)
    assert client.responses.cancel(r.id).status == "cancelled"
    later = client.responses.retrieve(r.id)
    assert later.status == "cancelled" and (later.usage is None or later.usage.output_tokens < 1500)


def test_streamed_response_is_stored(client) -> None:
    events = list(client.responses.create(model=E2E_MODEL, input="Hi", max_output_tokens=4, stream=True))
    final = events[-1].response
    assert events[0].response.store is True and final.store is True
    assert client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize("body", [{"background": True, "store": False}, {"background": True, "stream": True}])
def test_background_refusals_name_the_field(client, body) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=E2E_MODEL, input="x", max_output_tokens=2, **body)
    assert err.value.body["param"] == "background"


def test_unknown_query_parameters_are_400_naming_them(client, live_stack) -> None:
    r = client.responses.create(model=E2E_MODEL, input="x", max_output_tokens=2)
    auth = {"Authorization": f"Bearer {E2E_KEY}"}
    for path, query in ((f"/v1/responses/{r.id}", "include=reasoning.encrypted_content"), (f"/v1/responses/{r.id}", "stream=true"),
                        (f"/v1/responses/{r.id}/input_items", "include=x")):
        got = httpx.get(f"{live_stack.url}{path}?{query}", headers=auth)
        assert got.status_code == 400 and got.json()["error"]["param"] == query.split("=")[0]
