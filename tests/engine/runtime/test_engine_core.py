"""Continuous batching behaviour of EngineCore on the tiny model (fp32, CPU)."""

from __future__ import annotations

import random

import pytest

from engine.errors import InvalidRequestError
from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.state_pool import state_bytes
from tests.engine.runtime.helpers import greedy, prompt, run

LENGTHS = [5, 300, 40, 129, 17, 64, 250, 8, 90, 33, 200, 12, 150, 70, 3, 99]


def _engine(tiny_model, tiny_model_dir, **cfg):
    return build_engine(tiny_model_dir, EngineConfig(**cfg), model=tiny_model)


def _budget(tiny_model, max_seqs: int, blocks: int) -> int:
    """A state-memory budget holding ``max_seqs`` boundary states and exactly ``blocks`` units."""
    block, boundary = state_bytes(tiny_model.config, tiny_model.dtype)
    return max_seqs * boundary + blocks * block


def test_batch_invariance_greedy(tiny_model, tiny_model_dir) -> None:
    """A request gives the same greedy tokens and logprobs alone and inside a mixed batch of 16."""
    reqs = [GenerateRequest(f"r{i}", prompt(n, i), greedy(12)) for i, n in enumerate(LENGTHS)]
    batched = run(_engine(tiny_model, tiny_model_dir, max_num_batched_tokens=512), reqs)
    for i in (0, 1, 6, 14):
        alone = run(_engine(tiny_model, tiny_model_dir), [GenerateRequest("solo", reqs[i].prompt_token_ids, greedy(12))])["solo"]
        assert alone.tokens == batched[f"r{i}"].tokens
        assert max(abs(a - b) for a, b in zip(alone.logprobs, batched[f"r{i}"].logprobs)) < 1e-4


def test_plain_greedy_batch_equals_full_logits_argmax(tiny_model, tiny_model_dir) -> None:
    """Greedy requests without logprobs take the lm_head's int8 screen + exact recheck; in a
    mixed batch they give exactly the tokens of the model run alone with full fp32 logits."""
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"g{i}", prompt(n, 300 + i), plain) for i, n in enumerate(LENGTHS[:8])]
    engine = _engine(tiny_model, tiny_model_dir, max_num_batched_tokens=512)
    screened_before = tiny_model.head.screened_rows
    batched = run(engine, reqs)
    assert tiny_model.head.screened_rows > screened_before
    for r in reqs:
        state, feed, ref = tiny_model.new_state(), r.prompt_token_ids, []
        for _ in range(6):
            feed = [int(tiny_model([(state, feed)])[0].argmax())]
            ref += feed
        assert batched[r.request_id].tokens == ref, r.request_id


def test_seeded_sampling_reproducible_across_batches(tiny_model, tiny_model_dir) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    target = GenerateRequest("t", prompt(37, 99), params)
    alone = run(_engine(tiny_model, tiny_model_dir), [target])["t"].tokens
    others = [GenerateRequest(f"o{i}", prompt(n, 7 + i), SamplingParams(max_tokens=8, temperature=0.8, seed=i)) for i, n in enumerate((9, 70, 3))]
    mixed = run(_engine(tiny_model, tiny_model_dir), [others[1], GenerateRequest("t", target.prompt_token_ids, params), others[0], others[2]])
    assert mixed["t"].tokens == alone
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, seed=4321, ignore_eos=True)
    assert run(_engine(tiny_model, tiny_model_dir), [GenerateRequest("u", target.prompt_token_ids, unseeded)])["u"].tokens != alone


def test_abort_frees_all_state(tiny_model, tiny_model_dir) -> None:
    eng = _engine(tiny_model, tiny_model_dir, max_num_batched_tokens=64)
    for i, n in enumerate((200, 5, 80)):
        eng.add_request(GenerateRequest(f"a{i}", prompt(n, i), greedy(50)))
    eng.step()
    eng.step()
    assert eng.pool.usage > 0
    for i in range(3):
        assert eng.abort_request(f"a{i}")
    events = eng.step()
    assert sorted(e.request_id for e in events if e.finish_reason == "abort") == ["a0", "a1", "a2"]
    assert eng.pool.usage == 0.0 and not eng.has_work()
    eng.scheduler.check_integrity()
    assert not eng.abort_request("a0")


def test_preemption_and_resume_give_same_tokens(tiny_model, tiny_model_dir) -> None:
    """A state budget too small for all sequences forces recompute preemption; output unchanged."""
    reqs = [GenerateRequest(f"p{i}", prompt(n, 50 + i), greedy(40)) for i, n in enumerate((120, 130, 125, 140))]
    # the reference: the same batch with room for all (batch invariance is pinned above), one engine
    roomy = _engine(tiny_model, tiny_model_dir)
    ref = {rid: res.tokens for rid, res in run(roomy, [GenerateRequest(r.request_id, r.prompt_token_ids, r.sampling) for r in reqs]).items()}
    assert roomy.scheduler.num_preemptions == 0
    # 5 units of block memory: four sequences of 2 units each cannot all fit
    eng = _engine(tiny_model, tiny_model_dir, max_num_seqs=4, state_memory_bytes=_budget(tiny_model, 4, 5))
    assert eng.pool.num_blocks == 5
    out = run(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    for r in reqs:
        assert out[r.request_id].tokens == ref[r.request_id]


def test_state_pool_integrity_under_random_stress(tiny_model, tiny_model_dir) -> None:
    rng = random.Random(0)
    eng = _engine(tiny_model, tiny_model_dir, max_num_seqs=6, max_num_batched_tokens=96, state_memory_bytes=_budget(tiny_model, 6, 8))
    assert eng.pool.num_blocks == 8
    live: list[str] = []
    for i in range(60):
        action = rng.random()
        if action < 0.45:
            rid = f"s{i}"
            eng.add_request(GenerateRequest(rid, prompt(rng.randrange(1, 200), i), greedy(rng.randrange(1, 20))))
            live.append(rid)
        elif action < 0.6 and live:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        for ev in eng.step():
            if ev.finished and ev.request_id in live:
                live.remove(ev.request_id)
        eng.scheduler.check_integrity()
    while eng.has_work():
        eng.step()
        eng.scheduler.check_integrity()
    assert eng.pool.usage == 0.0


def test_invalid_requests_are_rejected(tiny_model, tiny_model_dir) -> None:
    eng = _engine(tiny_model, tiny_model_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError):
        eng.add_request(GenerateRequest("e", [], greedy(4)))
    with pytest.raises(InvalidRequestError):
        eng.add_request(GenerateRequest("v", [10**7], greedy(4)))
    with pytest.raises(InvalidRequestError):
        eng.add_request(GenerateRequest("l", prompt(60, 1), greedy(10)))


def test_migrated_request_continues_exactly(tiny_model, tiny_model_dir) -> None:
    """Resubmitting prompt + tokens so far continues with the uninterrupted run's tokens."""
    p = prompt(77, 3)
    full = run(_engine(tiny_model, tiny_model_dir), [GenerateRequest("f", p, greedy(20))])["f"].tokens
    resumed = run(_engine(tiny_model, tiny_model_dir), [GenerateRequest("m", p, greedy(20), output_token_ids=full[:9])])["m"].tokens
    assert resumed == full[9:]


def test_finish_event_carries_per_request_timing(tiny_model, tiny_model_dir) -> None:
    eng = _engine(tiny_model, tiny_model_dir)
    eng.add_request(GenerateRequest("t", prompt(30, 4), greedy(3)))
    finals = []
    while eng.has_work():
        finals += [ev for ev in eng.step() if ev.finished]
    (ev,) = finals
    t = ev.timing
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["e2e_s"]
    assert type(ev).from_dict(ev.to_dict()).timing == t  # survives the wire
