"""Prompt logprobs from the engine equal a direct forward's log_softmax (fp32, CPU), across
prefill chunks, beside other requests, and with a prefix-cache entry present (skipped for them)."""

from __future__ import annotations

import torch

from deepserve.protocol import GenerateRequest, SamplingParams, TokenEvent
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from tests.engine.runtime.helpers import greedy, memory_kv, prompt, run

TOP = 3


def _events(engine, reqs: list[GenerateRequest]) -> dict[str, list[TokenEvent]]:
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].append(ev)
    return out


def _reference(model, tokens: list[int]) -> torch.Tensor:
    """``(N - 1, V)`` log-probabilities of tokens 1.. given their prefixes, in one forward."""
    logits = model([(model.new_state(), tokens)], logits="all")  # (N, V)
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _check(entries, model, tokens: list[int]) -> None:
    ref = _reference(model, tokens)
    assert len(entries) == len(tokens) and entries[0] is None
    for p, e in enumerate(entries[1:]):
        row = ref[p]
        assert abs(e.logprob - row[tokens[p + 1]].item()) < 1e-4
        v = row[tokens[p + 1]]  # rank within the numerical noise of chunked vs one-shot forwards
        assert int((row > v + 1e-4).sum()) + 1 <= e.rank <= int((row > v - 1e-4).sum()) + 1
        best = row.topk(TOP)
        assert [t for t, _ in e.top] == best.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e.top, best.values.tolist())) < 1e-4


def test_prompt_logprobs_match_a_direct_forward_across_chunks(tiny_model, tiny_model_dir) -> None:
    """A 300-token prompt prefilled in 128-token chunks beside a plain request: every prompt
    token scored as one forward scores it, on the first token's event only; the plain request's
    tokens are those it gets alone."""
    engine = build_engine(tiny_model_dir, EngineConfig(max_num_batched_tokens=128), model=tiny_model)
    tokens, other = prompt(300, 1), prompt(40, 2)
    scored = GenerateRequest("pl", tokens, greedy(4, prompt_logprobs=TOP))
    events = _events(engine, [scored, GenerateRequest("plain", other, greedy(4))])
    first, *rest = events["pl"]
    _check(first.prompt_logprobs, tiny_model, tokens)
    assert all(ev.prompt_logprobs is None for ev in rest + events["plain"])
    alone = run(build_engine(tiny_model_dir, model=tiny_model), [GenerateRequest("solo", other, greedy(4))])
    assert [t for ev in events["plain"] for t in ev.token_ids] == alone["solo"].tokens


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model, tiny_model_dir) -> None:
    """With the prompt's units stored, a request asking for prompt logprobs computes the whole
    prompt (no cached tokens) and still scores every token; one that does not ask hits."""
    engine = build_engine(tiny_model_dir, model=tiny_model)
    engine.kv = memory_kv(tiny_model)
    tokens = prompt(300, 3)
    run(engine, [GenerateRequest("warm", tokens, greedy(2))])
    hit = run(engine, [GenerateRequest("hit", tokens, greedy(2))])["hit"]
    assert hit.cached >= 256
    events = _events(engine, [GenerateRequest("pl", tokens, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP))])
    first = events["pl"][0]
    assert first.num_cached_tokens == 0
    _check(first.prompt_logprobs, tiny_model, tokens)
    assert [t for ev in events["pl"] for t in ev.token_ids] == hit.tokens


def test_prompt_logprobs_round_trip_the_wire() -> None:
    """The event's wire form keeps logprob, rank and alternatives, and the leading null."""
    from deepserve.protocol import TokenLogprob

    ev = TokenEvent("r", [5], prompt_logprobs=[None, TokenLogprob(-1.5, [(3, -0.5)], 2)])
    back = TokenEvent.from_dict(ev.to_dict())
    assert back.prompt_logprobs == ev.prompt_logprobs
