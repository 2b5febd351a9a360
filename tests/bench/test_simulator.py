"""The simulator on tiny traces: conservation, exact answers where they are analytic, and the
router's own code making the decisions."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.simulator.cost_model import CacheModel, CostModel, DecodeCost, PrefillCost
from bench.simulator.report import summarize
from bench.simulator.sim import SimConfig, UnitKeys, simulate
from bench.workloads import BlockContent, TraceGenConfig, generate
from bench.workloads.trace import TraceRow
from kvstore.keys import chain_keys
from router.config import RouterConfig

FLAT = CostModel(
    prefill=PrefillCost(fixed_s=0.01, per_token_s=1e-4, per_token_ctx_s=0.0, max_batch_tokens=100_000),
    decode=DecodeCost(fixed_s=0.02, per_seq_s=0.0, per_ctx_token_s=0.0, max_batch=64),
    kv_transfer_fixed_s=0.005, kv_transfer_s_per_token=0.0,
)


def _rows(n: int, prompt: int, output: int, gap_ms: float, shared: bool = False) -> list[TraceRow]:
    # 512-token trace blocks; unique ids per request unless shared
    nb = -(-prompt // 512)
    return [TraceRow(i * gap_ms, prompt, output, tuple(range(nb)) if shared else tuple(range(i * nb, (i + 1) * nb))) for i in range(n)]


def test_one_worker_sequential_fixed_costs_exact() -> None:
    rows = _rows(5, 1000, 11, gap_ms=10_000)  # far apart: no queueing, no batching
    sim = simulate(SimConfig(prefill=0, decode=1), FLAT, rows)
    for r in sim.requests:
        assert r.first_token - r.arrival == pytest.approx(0.01 + 1000 * 1e-4)  # TTFT = fixed + tokens x cost
        assert r.finish - r.first_token == pytest.approx(10 * 0.02)  # 10 more tokens, one step each
    s = summarize(sim)
    assert s["ttft_s"]["p50"] == pytest.approx(0.11) and s["tpot_s"]["mean"] == pytest.approx(0.02)
    assert s["cache_hit_rate"] == 0.0


def test_disaggregated_adds_the_handoff_exactly() -> None:
    rows = _rows(3, 1000, 6, gap_ms=10_000)
    cfg = SimConfig(prefill=1, decode=1, router=RouterConfig(pd_min_prompt_tokens=512))
    sim = simulate(cfg, FLAT, rows)
    for r in sim.requests:
        assert r.stage == "prefill" and r.prefill_worker == "p0" and r.decode_worker == "d0"
        assert r.first_token - r.arrival == pytest.approx(0.11)
        assert r.finish - r.first_token == pytest.approx(0.005 + 5 * 0.02)  # transfer, then 5 steps


def test_queueing_behind_a_busy_prefill_rank() -> None:
    rows = _rows(3, 1000, 1, gap_ms=0)  # three at once on one rank, budget of one prompt per step
    cost = dataclasses.replace(FLAT, prefill=dataclasses.replace(FLAT.prefill, max_batch_tokens=1000))
    sim = simulate(SimConfig(decode=1), cost, rows)
    ttfts = sorted(r.first_token - r.arrival for r in sim.requests)
    assert ttfts == pytest.approx([0.11, 0.22, 0.33])


def test_prefix_hit_is_whole_units_and_cuts_prefill() -> None:
    rows = _rows(2, 1000, 1, gap_ms=10_000, shared=True)  # the same prompt twice
    sim = simulate(SimConfig(decode=1), FLAT, rows)
    first, second = sim.requests
    assert first.cached_local == 0
    assert second.cached_local == 896  # 7 whole 128-token units of 1000 tokens
    assert second.first_token - second.arrival == pytest.approx(0.01 + (1000 - 896) * 1e-4)


def test_conservation_on_a_generated_trace_all_policies_and_shapes() -> None:
    rows = generate(TraceGenConfig(seed=4, num_sessions=30, session_rate=20, think_time_s=0.5, system_median=1500, user_median=300, output_median=40))
    n = len(rows)
    for policy in ("cache_aware", "round_robin", "least_load", "power_of_two", "session_affinity"):
        for shape in ({"prefill": 0, "decode": 3}, {"prefill": 2, "decode": 3, "dp_size": 2}):
            sim = simulate(SimConfig(policy=policy, **shape), CostModel(), rows)
            assert len(sim.requests) == n
            for r in sim.requests:
                assert r.finish is not None and r.first_token is not None and r.arrival <= r.first_token <= r.finish
                assert r.lease is None  # every lease released
            for w in sim.workers:  # nothing left anywhere; router accounting back to zero
                assert not w.busy and not w.finish_heap
                for rank in w.ranks:
                    assert not rank.running and not rank.waiting and not rank.prefill_q and rank.ctx_sum == 0
                    v = rank.view
                    assert v.in_flight == 0 and v.in_flight_tokens == 0 and v.pending_prefill_tokens == 0
            assert summarize(sim)["completed"] == n


def test_macro_steps_equal_single_steps() -> None:
    rows = generate(TraceGenConfig(seed=7, num_sessions=15, session_rate=30, think_time_s=0.2, user_median=200, output_median=30))
    cost = dataclasses.replace(CostModel(), decode=dataclasses.replace(CostModel().decode, max_batch=4))  # waiting too
    a = simulate(SimConfig(decode=2), cost, rows)
    b = simulate(SimConfig(decode=2, macro_steps=False), cost, rows)
    for x, y in zip(a.requests, b.requests):
        assert x.first_token == pytest.approx(y.first_token, abs=1e-9)
        assert x.finish == pytest.approx(y.finish, abs=1e-9)


def test_cache_aware_beats_round_robin_on_shared_prefixes() -> None:
    rows = generate(TraceGenConfig(seed=1, num_sessions=60, session_rate=10, think_time_s=1, system_median=3000, user_median=200, output_median=20, num_system_prompts=6))
    ca = summarize(simulate(SimConfig(decode=4, policy="cache_aware"), CostModel(), rows))
    rr = summarize(simulate(SimConfig(decode=4, policy="round_robin"), CostModel(), rows))
    assert ca["cache_hit_rate"] > rr["cache_hit_rate"]


def test_shared_store_hits_count_when_local_misses() -> None:
    cost = dataclasses.replace(FLAT, cache=CacheModel(hbm_tokens_per_rank=128, store_tier="fs", store_tokens=10_000_000),
                               kv_load_s_per_token={"memory": 0.0, "fs": 1e-5})
    rows = _rows(2, 1000, 1, gap_ms=10_000, shared=True)
    sim = simulate(SimConfig(decode=1), cost, rows)
    second = sim.requests[1]
    assert second.cached_local == 0 and second.cached_shared == 896  # evicted locally, found in the store
    assert second.first_token - second.arrival == pytest.approx(0.01 + 104 * 1e-4 + 896 * 1e-5)


def test_unit_keys_equal_chain_keys() -> None:
    uk = UnitKeys(512, 128, "fp", seed=0)
    content = BlockContent(512, seed=0)
    for i, row in enumerate([TraceRow(0, 1300, 1, (1, 2, 3)), TraceRow(0, 1700, 1, (1, 2)), TraceRow(0, 100, 1, (9,))]):
        assert uk.keys(row, i) == tuple(chain_keys(content.token_ids(row.hash_ids, row.input_length, i), 128, "fp"))
    odd = UnitKeys(100, 128, "fp")  # trace block not a multiple of the unit: the slow path
    row = TraceRow(0, 450, 1, (1, 2, 3, 4, 5))
    assert odd.keys(row, 0) == tuple(chain_keys(BlockContent(100).token_ids(row.hash_ids, 450, 0), 128, "fp"))


def test_cost_model_json_roundtrip(tmp_path) -> None:
    p = tmp_path / "c.json"
    FLAT.save(p)
    assert CostModel.load(p) == FLAT
    default = CostModel.load()  # the shipped default parses and round-trips too
    assert CostModel.from_dict(json.loads(json.dumps(default.to_dict()))) == default and default.block_size == 128


def test_cli_runs_policies_and_writes_json(tmp_path) -> None:
    from deepserve.cli import main

    out = tmp_path / "sim.json"
    rc = main(["simulate", "--trace", "multi_turn:num_sessions=10", "--prefill", "1", "--decode", "2", "--policy", "cache_aware", "round_robin",
               "--slo-ttft", "1", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["runs"]] == ["cache_aware", "round_robin"]
    assert doc["runs"][0]["summary"]["completed"] == doc["runs"][0]["summary"]["requests"] > 0
    assert len(doc["runs"][0]["per_rank"]) == 3
