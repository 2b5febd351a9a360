"""A preempted sequence resumes from the KV store (its last stored unit), not from token 0, and
its greedy tokens equal an uninterrupted run (tiny model, fp32, CPU)."""

from __future__ import annotations

from deepserve.protocol import GenerateRequest
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.state_pool import state_bytes
from tests.engine.runtime.helpers import Result, greedy, memory_kv, prompt

UNIT = 128


def _engine(model, model_dir, **cfg):
    eng = build_engine(model_dir, EngineConfig(snapshot_interval_units=1, **cfg), model=model)
    eng.kv = memory_kv(model)
    return eng


def _drive(eng, reqs) -> tuple[dict[str, Result], dict[str, tuple[int, int]]]:
    """Run to completion; per request preempted and back: (tokens its state held when it was
    preempted, tokens the KV store gave back on re-admission; 0 = recomputed from scratch)."""
    out = {r.request_id: Result() for r in reqs}
    for r in reqs:
        eng.add_request(r)
    held: dict[str, int] = {}
    back: dict[str, tuple[int, int]] = {}
    while eng.has_work():
        before = {rid: s.num_computed for rid, s in eng.seqs.items()}
        for ev in eng.step():
            out[ev.request_id].tokens += ev.token_ids
        for s in list(eng.seqs.values()):
            rid = s.request_id
            if s in eng.scheduler.waiting and s.num_preemptions and not s.kv_checked and before.get(rid):
                held[rid] = before[rid]  # preempted this step (state dropped, lookup pending)
                back.pop(rid, None)
            elif rid in held and rid not in back and s.kv_checked:
                # the lookup ran: a restore set num_cached (> 0, reset by the preemption) and
                # num_computed = saved_upto = where the store resumed it; a miss leaves num_cached 0
                back[rid] = (held[rid], s.saved_upto if s.num_cached else 0)
        eng.scheduler.check_integrity()
    return out, back


def test_preempted_sequences_resume_from_the_store_exactly(tiny_model, tiny_model_dir) -> None:
    """Three sequences of 2 units grow to 3 units each in 7: the last is preempted while decoding
    (past the decode snapshot at 256) and comes back from the store there, not from token 0."""
    reqs = [GenerateRequest(f"p{i}", prompt(n, 70 + i), greedy(90)) for i, n in enumerate((200, 205, 210))]
    ref, _ = _drive(_engine(tiny_model, tiny_model_dir), reqs)
    block, boundary = state_bytes(tiny_model.config, tiny_model.dtype)
    eng = _engine(tiny_model, tiny_model_dir, max_num_seqs=3, state_memory_bytes=3 * boundary + 7 * block)
    out, back = _drive(eng, [GenerateRequest(r.request_id, r.prompt_token_ids, r.sampling) for r in reqs])
    assert eng.scheduler.num_preemptions > 0 and back
    for rid, (at, start) in back.items():
        # back from the last unit stored before the preemption (prompt end or a decode boundary)
        assert 2 * UNIT <= (at // UNIT) * UNIT <= start <= at + 1, (rid, at, start)
    assert {rid: r.tokens for rid, r in out.items()} == {rid: r.tokens for rid, r in ref.items()}
