"""Prompt logprobs end to end: the real `openai` SDK against the live `deepserve up` stack over
loopback (a real worker process, fp32), every value checked against a direct forward of the
checkpoint it serves.

vLLM's ``prompt_logprobs`` (completions: per choice; chat: on the answer) and OpenAI's legacy
``echo`` + ``logprobs`` (the first echoed token null), with ``max_tokens: 0`` (scoring only) and
with the prompt's KV units already cached (the request computes the whole prompt anyway).
"""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

from server.up import UpOptions
from tests.server.conftest import E2E_KEY, E2E_MODEL, engine_missing_reason

pytestmark = pytest.mark.skipif(engine_missing_reason() is not None, reason=engine_missing_reason() or "")

MODEL = E2E_MODEL
AUTH = {"Authorization": f"Bearer {E2E_KEY}"}
TOL = 2e-4  # fp32 on both sides (the tiny checkpoint's dtype); chunked prefill vs one forward


@pytest.fixture(scope="module")
def stack(live_stack):
    return live_stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=E2E_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(stack):
    """``ids -> (N - 1, V)`` log-probabilities of ids[1:] from one forward of the checkpoint the
    live stack serves (``deepserve up``'s default: ``<cache dir>/tiny-v4``)."""
    from engine.model.loader import load_model

    model = load_model(UpOptions.default_cache_dir() / "tiny-v4", dtype="float32", progress=False)

    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model([(model.new_state(), ids)], logits="all")[:-1].float(), dim=-1)

    return logprobs


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100000) for _ in range(n)]


def _check_vllm(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: None first; then {id: {logprob, rank, decoded_token}}, the prompt token first."""
    assert len(entries) == len(ids) and entries[0] is None
    for p, pos in enumerate(entries[1:], start=1):
        row = ref[p - 1]
        first, *alts = pos.items()
        assert int(first[0]) == ids[p]
        assert abs(first[1]["logprob"] - row[ids[p]].item()) < TOL
        assert first[1]["rank"] >= 1 and isinstance(first[1]["decoded_token"], str)
        best = row.topk(k)
        assert {int(t) for t in pos} == {ids[p], *best.indices.tolist()}
        for t, v in pos.items():
            assert abs(v["logprob"] - row[int(t)].item()) < TOL


def test_completions_prompt_logprobs_match_a_direct_forward(client, reference) -> None:
    ids = _ids(40, 1)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3})
    _check_vllm(r.choices[0].model_extra["prompt_logprobs"], ids, reference(ids), 3)


def test_echo_logprobs_score_the_prompt_with_max_tokens_zero(client, reference) -> None:
    """OpenAI's loglikelihood idiom: echo + logprobs + max_tokens 0 -> the prompt's tokens and
    logprobs (the first null), no completion tokens."""
    ids = _ids(30, 2)
    ref = reference(ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1][ids[p]].item()) < TOL
        assert sorted(lp.top_logprobs[p].values(), reverse=True) == pytest.approx(ref[p - 1].topk(2).values.tolist(), abs=TOL)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"


def test_echo_logprobs_stream_and_text_prompt(client, reference, stack) -> None:
    """A streamed text prompt: the echo chunk carries the prompt's scores (BOS hidden, first null)."""
    text = "The quick brown fox jumps over the lazy dog"
    ids = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": text}, headers=AUTH).json()["tokens"]  # BOS first
    ref = reference(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True, logprobs=1, stream=True, temperature=0))
    head = chunks[0].choices[0]
    assert head.text == text
    assert len(head.logprobs.tokens) == len(ids) - 1 and head.logprobs.token_logprobs[0] is None
    for p in range(2, len(ids)):
        assert abs(head.logprobs.token_logprobs[p - 1] - ref[p - 1][ids[p]].item()) < TOL


def test_chat_prompt_logprobs_are_the_rendered_prompts(client, reference, stack) -> None:
    messages = [{"role": "user", "content": "Score every token of this prompt."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = r.model_extra["prompt_logprobs"]
    ids = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "messages": messages}, headers=AUTH).json()["tokens"]
    _check_vllm(entries, ids, reference(ids), 0)


def test_prefix_cache_hit_does_not_lose_prompt_logprobs(client, reference) -> None:
    """The prompt's units are cached (a plain repeat hits them); a prompt_logprobs request still
    scores every token, with no cached tokens."""
    ids = _ids(300, 3)
    client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    hit = client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    assert hit.usage.prompt_tokens_details.cached_tokens >= 256
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    _check_vllm(r.choices[0].model_extra["prompt_logprobs"], ids, reference(ids), 1)


@pytest.mark.parametrize("body", [{"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": "2"}])
def test_bad_prompt_logprobs_are_400_naming_the_field(client, body) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=body)
    assert err.value.body["param"] == "prompt_logprobs"
