"""The scheduler on fake capacity, without a model: token budget, sequence limit, priorities,
chunked prefill, snapshot stops, KV loads, and preemption when the state pool runs out.

The pool is the real ``StatePool`` (128-token block slots, one boundary slot per sequence) with a
byte budget of exactly ``blocks`` blocks; a step is simulated by advancing ``num_computed`` by the
scheduled tokens and appending a sampled token to each sequence that reached its end.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from engine.model.config import ModelConfig
from deepserve.protocol import GenerateRequest
from engine.runtime.config import EngineConfig
from engine.runtime.scheduler import Scheduler, SchedulerOutput
from engine.runtime.sequence import Sequence, Status
from engine.runtime.state_pool import StatePool, state_bytes


@pytest.fixture(scope="module")
def model_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model_dir)


def scheduler(model_config: ModelConfig, *, blocks: int, budget: int = 512, max_seqs: int = 4, prefill_cap: int | None = 0) -> Scheduler:
    """A scheduler whose pool holds exactly ``blocks`` block slots (``blocks * 128`` tokens);
    ``prefill_cap`` 0: fair prefill off (chunks up to the budget), None: its default."""
    block, boundary = state_bytes(model_config, torch.float32)
    pool = StatePool(model_config, torch.float32, max_seqs * boundary + blocks * block, max_seqs)
    assert pool.num_blocks == blocks
    threshold = budget if prefill_cap == 0 else prefill_cap
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, state_memory_bytes=1, long_prefill_token_threshold=threshold)
    return Scheduler(config, pool)


def seq(rid: str, prompt_len: int, *, arrival: float, priority: int = 0) -> Sequence:
    tokens = list(range(2, 2 + prompt_len))
    req = GenerateRequest(rid, tokens, priority=priority)
    return Sequence(request=req, sampling=None, tokens=list(tokens), num_prompt=prompt_len, arrival=arrival)  # type: ignore[arg-type]


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule one step and play the engine's part: feed the tokens, sample at each end."""
    out = s.schedule()
    for q, n in out.scheduled:
        q.num_computed += n
        if q.remaining == 0:
            q.tokens.append(1)
    s.check_integrity()
    return out


def fed(out: SchedulerOutput) -> dict[str, int]:
    return {q.request_id: n for q, n in out.scheduled}


def test_token_budget_chunks_prefill_and_mixes_it_with_decodes(model_config) -> None:
    s = scheduler(model_config, blocks=16, budget=64)
    a, b = seq("a", 100, arrival=0), seq("b", 30, arrival=1)
    s.add(a)
    s.add(b)
    assert fed(step(s)) == {"a": 64}  # the budget is spent on a's first chunk; b waits
    assert fed(step(s)) == {"a": 36, "b": 28}  # a's last chunk, b admitted with what is left
    assert fed(step(s)) == {"a": 1, "b": 2}  # a decodes, b finishes its prompt in the same batch
    assert fed(step(s)) == {"a": 1, "b": 1}
    assert a.status is b.status is Status.RUNNING and not s.waiting


def test_fair_prefill_admits_a_short_prompt_beside_a_long_one(model_config) -> None:
    """A long prompt alone takes the whole budget; once a short one arrives, the long one's chunk
    is capped (half the budget by default) and the short one is prefilled in the same step."""
    s = scheduler(model_config, blocks=16, budget=64, prefill_cap=None)
    long = seq("long", 1000, arrival=0)
    s.add(long)
    assert fed(step(s)) == {"long": 64}
    short = seq("short", 20, arrival=1)
    s.add(short)
    assert fed(step(s)) == {"long": 32, "short": 20}
    assert fed(step(s)) == {"long": 32, "short": 1}  # short decodes while long keeps its half
    s.remove(short)
    assert fed(step(s)) == {"long": 64}  # alone again: the whole budget


def test_fair_prefill_threshold_is_configurable_and_decodes_keep_their_turn(model_config) -> None:
    s = scheduler(model_config, blocks=16, budget=64, prefill_cap=16)
    a, b = seq("a", 4, arrival=0), seq("b", 500, arrival=1)
    s.add(a)
    s.add(b)
    assert fed(step(s)) == {"a": 4, "b": 16}
    assert fed(step(s)) == {"a": 1, "b": 16}
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=0)


def test_sequence_limit_and_priority_order_admission(model_config) -> None:
    s = scheduler(model_config, blocks=16, max_seqs=2)
    late_urgent = seq("urgent", 10, arrival=2, priority=-1)
    for q in (seq("first", 10, arrival=0), seq("second", 10, arrival=1), late_urgent):
        s.add(q)
    assert fed(step(s)) == {"urgent": 10, "first": 10}  # lower priority value first, then arrival
    assert [q.request_id for q in s.waiting] == ["second"]
    assert fed(step(s)) == {"urgent": 1, "first": 1}  # two running: the limit keeps "second" out


def test_chunk_stops_at_the_snapshot_point_and_loading_sequences_wait(model_config) -> None:
    s = scheduler(model_config, blocks=16)
    a, b = seq("a", 300, arrival=0), seq("b", 20, arrival=1)
    a.snapshot_at = 256  # the prompt's last whole unit: its state must exist once, exactly
    b.kv_load = Future()  # its prefix is still loading from the KV store
    s.add(a)
    s.add(b)
    assert fed(step(s)) == {"a": 256}
    assert fed(step(s)) == {"a": 44}
    b.kv_load = None
    assert fed(step(s)) == {"a": 1, "b": 20}


def test_preemption_when_the_pool_runs_out(model_config) -> None:
    """Four blocks for two 250-token prompts: the first to cross 256 tokens takes a third block
    from the lowest-ranked running sequence, which is recomputed later from its tokens."""
    s = scheduler(model_config, blocks=4)
    a, b = seq("a", 250, arrival=0), seq("b", 250, arrival=1)
    s.add(a)
    s.add(b)
    assert fed(step(s)) == {"a": 250, "b": 250} and s.pool.free_blocks == 0
    for _ in range(6):  # decode both up to 256 computed tokens: still two blocks each
        assert fed(step(s)) == {"a": 1, "b": 1}
    out = step(s)  # a's 257th token needs a third block
    assert fed(out) == {"a": 1} and out.preempted == [b]
    assert b.status is Status.WAITING and b.num_computed == 0 and not b.block_ids and b.num_preemptions == 1
    assert len(b.tokens) == 257 and s.waiting == [b] and s.num_preemptions == 1
    assert fed(step(s)) == {"a": 1}  # b needs three blocks again, one is free: admission waits
    s.remove(a)  # a finishes
    assert fed(step(s)) == {"b": 257}  # recomputed in one chunk, prompt and sampled tokens alike
    assert b.status is Status.RUNNING and len(b.block_ids) == 3


def test_a_victim_is_not_admitted_again_in_the_step_that_preempted_it(model_config) -> None:
    """Its freed block would take a 128-token chunk of it at once, from token 0; it waits a step
    instead, so the engine can look its prefix up in the KV store first."""
    s = scheduler(model_config, blocks=4, prefill_cap=128)
    a, b = seq("a", 250, arrival=0), seq("b", 200, arrival=1)
    s.add(a)
    s.add(b)
    assert fed(step(s)) == {"a": 128, "b": 128}
    assert fed(step(s)) == {"a": 122, "b": 72} and s.pool.free_blocks == 0
    for _ in range(6):
        assert fed(step(s)) == {"a": 1, "b": 1}
    out = step(s)  # a's 257th token takes one of b's two blocks
    assert out.preempted == [b] and fed(out) == {"a": 1} and s.pool.free_blocks == 1
    assert fed(step(s)) == {"a": 1, "b": 128}


def test_the_victim_is_the_lowest_ranked_and_admission_never_preempts(model_config) -> None:
    s = scheduler(model_config, blocks=3)
    low, high = seq("low", 128, arrival=0, priority=5), seq("high", 200, arrival=1)
    s.add(low)
    s.add(high)
    assert fed(step(s)) == {"high": 200, "low": 128} and s.pool.free_blocks == 0
    waiting = seq("waiting", 10, arrival=2, priority=-9)
    s.add(waiting)
    out = step(s)  # low's 129th token needs a block: it ranks last, nobody below it to preempt
    assert fed(out) == {"high": 1} and out.preempted == []  # waiting is not admitted by preempting
    assert low.status is Status.RUNNING and waiting.status is Status.WAITING
    for _ in range(55):  # high decodes to 256 computed tokens within its two blocks
        assert fed(step(s)) == {"high": 1}
    out = step(s)  # high needs a third block: low (priority 5) is preempted for it
    assert fed(out) == {"high": 1} and out.preempted == [low]
    assert low.status is Status.WAITING and low.num_computed == 0 and [q.request_id for q in s.waiting] == ["waiting", "low"]


def test_a_sequence_with_no_victim_waits_without_preempting(model_config) -> None:
    s = scheduler(model_config, blocks=1)
    a = seq("a", 100, arrival=0)
    s.add(a)
    assert fed(step(s)) == {"a": 100}
    for _ in range(28):
        step(s)
    assert a.num_computed == 128
    out = step(s)  # a 129th token needs a second block and there is no one to take it from
    assert out.scheduled == [] and out.preempted == [] and a.status is Status.RUNNING
