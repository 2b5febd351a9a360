"""Reasoning caps end to end on the live stack (a real worker): Anthropic's
``thinking.budget_tokens`` through the `anthropic` SDK and Responses ``reasoning.max_tokens``
through the `openai` SDK end the reasoning after that many tokens; bad values are 400s."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import E2E_KEY, E2E_MODEL, engine_missing_reason

pytestmark = pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or "")

PROMPT = [{"role": "user", "content": "Think about it, then answer."}]


@pytest.fixture(scope="module")
def claude(live_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_stack.url, api_key=E2E_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(live_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_KEY, max_retries=0, timeout=120)


def test_responses_reasoning_max_tokens_caps_the_reasoning(oai) -> None:
    free = oai.responses.create(model=E2E_MODEL, input="Think.", max_output_tokens=24, temperature=0)
    capped = oai.responses.create(model=E2E_MODEL, input="Think.", max_output_tokens=24, temperature=0, reasoning={"max_tokens": 5})
    assert free.usage.output_tokens_details.reasoning_tokens > 5  # the tiny model reasons on unless stopped
    assert capped.usage.output_tokens_details.reasoning_tokens == 5
    assert capped.output_text  # the answer started after the forced end of the reasoning


def test_anthropic_budget_tokens_caps_the_thinking(claude) -> None:
    free = claude.messages.create(model=E2E_MODEL, max_tokens=24, extra_body={"temperature": 0}, messages=PROMPT,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    capped = claude.messages.create(model=E2E_MODEL, max_tokens=24, extra_body={"temperature": 0}, messages=PROMPT,
                                    thinking={"type": "enabled", "budget_tokens": 4})
    assert [b.type for b in free.content] == ["thinking"]  # 24 tokens of thinking: the budget never binds
    assert [b.type for b in capped.content][:1] == ["thinking"] and "text" in [b.type for b in capped.content]
    assert len(capped.content[0].thinking) < len(free.content[0].thinking)


@pytest.mark.parametrize("reasoning,param", [({"max_tokens": 0}, "reasoning.max_tokens"), ({"bogus": 1}, "reasoning.bogus")])
def test_bad_responses_reasoning_is_400_naming_it(oai, reasoning, param) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=E2E_MODEL, input="x", max_output_tokens=4, reasoning=reasoning)
    assert err.value.body["param"] == param


def test_bad_budget_tokens_is_400_naming_it(claude) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=E2E_MODEL, max_tokens=8, messages=PROMPT, thinking={"type": "enabled", "budget_tokens": -3})
    assert "thinking.budget_tokens" in err.value.message
