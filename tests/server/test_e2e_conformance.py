"""Observable effects of the sampling fields against a live `deepserve up` (tiny random model, CPU),
through the real `openai` and `anthropic` SDKs: a +100 ``logit_bias`` token is what gets sampled,
``min_tokens`` delays EOS, ``ignore_eos`` runs past it, ``stop_token_ids`` ends the answer,
``n: 3`` gives three distinct seeded choices, temperature 0 is greedy in thinking mode.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import E2E_KEY, E2E_MODEL, engine_missing_reason

pytestmark = pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or "")

USER = [{"role": "user", "content": "Say something."}]
NO_THINK = {"thinking": {"type": "disabled"}}
EOS = 1
HELLO = 33310  # "hello" in the V4 tokenizer (one token)


@pytest.fixture(scope="module")
def client(live_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_KEY, max_retries=0, timeout=300)


def test_hello_is_one_token(live_stack):
    tok = httpx.post(live_stack.url + "/tokenize", json={"model": E2E_MODEL, "prompt": "hello", "add_special_tokens": False},
                     headers={"Authorization": f"Bearer {E2E_KEY}"})
    assert tok.json()["tokens"] == [HELLO]


def test_logit_bias_token_is_sampled(client):
    r = client.chat.completions.create(
        model=E2E_MODEL, messages=USER, max_tokens=4, seed=3, logit_bias={str(HELLO): 100}, extra_body=NO_THINK,
    )
    assert r.choices[0].message.content == "hello" * 4
    c = client.completions.create(model=E2E_MODEL, prompt=[5, 6, 7], max_tokens=3, logit_bias={str(HELLO): 100})
    assert c.choices[0].text == "hello" * 3


def test_min_tokens_delays_eos_and_ignore_eos_runs_past_it(client):
    eos_first = {str(EOS): 100}
    plain = client.completions.create(model=E2E_MODEL, prompt=[5, 6, 7], max_tokens=20, logit_bias=eos_first)
    assert plain.usage.completion_tokens == 0 and plain.choices[0].finish_reason == "stop"
    held = client.completions.create(model=E2E_MODEL, prompt=[5, 6, 7], max_tokens=20, logit_bias=eos_first, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    past = client.completions.create(model=E2E_MODEL, prompt=[5, 6, 7], max_tokens=6, logit_bias=eos_first, extra_body={"ignore_eos": True})
    assert past.usage.completion_tokens == 6 and past.choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_answer(client):
    r = client.completions.create(
        model=E2E_MODEL, prompt=[5, 6, 7], max_tokens=20, logit_bias={str(HELLO): 100}, extra_body={"stop_token_ids": [HELLO]},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1 and r.choices[0].text == "hello"


def test_n_gives_distinct_reproducible_seeded_choices(client):
    def run() -> list[str]:
        r = client.chat.completions.create(model=E2E_MODEL, messages=USER, max_tokens=12, n=3, seed=11, temperature=1.0, extra_body=NO_THINK)
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.message.content for c in r.choices]

    first = run()
    assert len(set(first)) == 3
    assert run() == first
    one = client.chat.completions.create(model=E2E_MODEL, messages=USER, max_tokens=12, seed=12, temperature=1.0, extra_body=NO_THINK)
    assert one.choices[0].message.content == first[1]  # choice 1 samples the stream of seed + 1


def test_temperature_zero_is_greedy_in_thinking_mode(client, live_stack):
    answers = {
        client.chat.completions.create(model=E2E_MODEL, messages=USER, max_tokens=10, temperature=0).choices[0].message.model_extra["reasoning_content"]
        for _ in range(2)
    }
    assert len(answers) == 1
    a = anthropic.Anthropic(base_url=live_stack.url, api_key=E2E_KEY, max_retries=0)
    texts = {
        "".join(b.thinking for b in a.messages.create(
            model=E2E_MODEL, max_tokens=10, messages=USER,
            extra_body={"temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024}}).content if b.type == "thinking")
        for _ in range(2)
    }
    assert len(texts) == 1
