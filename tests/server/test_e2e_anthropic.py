"""End to end: the real `anthropic` SDK against a live `deepserve up` (/v1/messages)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.conftest import E2E_KEY, E2E_MODEL, engine_missing_reason

pytestmark = pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or "")

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(live_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_stack.url, api_key=E2E_KEY, max_retries=0, timeout=300)


def test_messages_non_stream(client):
    m = client.messages.create(model=E2E_MODEL, max_tokens=16, messages=MESSAGES, thinking={"type": "disabled"})
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert all(b.type in ("text", "thinking", "tool_use") for b in m.content)
    assert m.usage.output_tokens <= 16 and m.usage.input_tokens >= 0


def test_messages_stream_thinking(client):
    with client.messages.stream(
        model=E2E_MODEL, max_tokens=16, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and "message_stop" in events
    assert final.content and final.content[0].type == "thinking"


def test_messages_errors_are_anthropic_shaped(live_stack, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live_stack.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=E2E_MODEL, max_tokens=4, messages=MESSAGES
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=MESSAGES)
    r = httpx.post(live_stack.url + "/v1/messages", json={"model": E2E_MODEL, "max_tokens": 4, "messages": []}, headers={"x-api-key": E2E_KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
