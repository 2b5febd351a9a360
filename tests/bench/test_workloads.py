"""Workload generators: seeded runs identical; hash ids follow content identity (prefix sharing)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from bench.workloads import TraceGenConfig, generate, make_workload, parse_spec, read_trace, trace_stats, write_trace
from bench.workloads.content import BlockContent
from bench.workloads.trace import TraceRow


def _same_rows(a, b) -> bool:
    return [r.to_dict() for r in a] == [r.to_dict() for r in b]


@pytest.mark.parametrize("spec", ["fixed", "chat", "chat:dist=pareto,alpha=1.2", "multi_turn", "tool_agent", "fixed:rate=10,shared_prefix=1024"])
def test_seeded_runs_identical(spec: str) -> None:
    a = make_workload(spec, 60, seed=5)
    b = make_workload(spec, 60, seed=5)
    c = make_workload(spec, 60, seed=6)
    assert len(a.rows) == 60 and _same_rows(a.rows, b.rows)
    if spec != "fixed":  # fixed lengths without a rate have nothing random
        assert not _same_rows(a.rows, c.rows)


def test_rows_are_consistent() -> None:
    for spec in ("fixed", "chat", "multi_turn", "tool_agent"):
        wl = make_workload(spec, 80, seed=1)
        for r in wl.rows:
            assert len(r.hash_ids) == -(-r.input_length // wl.block_size), spec
            assert r.output_length >= 1
        ts = [r.timestamp for r in wl.rows]
        assert ts == sorted(ts)


def test_trace_gen_prefix_sharing_follows_content() -> None:
    cfg = TraceGenConfig(seed=3, block_size=64, num_sessions=40, num_system_prompts=3, system_median=300, user_median=100, output_median=50, mean_turns=4)
    rows = generate(cfg)
    bs = cfg.block_size
    by_session: dict[str, list[TraceRow]] = {}
    for r in rows:
        by_session.setdefault(r.session_id, []).append(r)
    multi = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, cur in itertools.pairwise(turns):
            multi += 1
            assert cur.input_length > prev.input_length + prev.output_length - 1
            whole = prev.input_length // bs
            # the whole blocks of the previous prompt are kept; everything after is new
            assert cur.hash_ids[:whole] == prev.hash_ids[:whole]
            assert set(cur.hash_ids[whole:]).isdisjoint(prev.hash_ids)
    assert multi > 20
    # sessions with the same system prompt share its whole blocks; ids are otherwise session-unique
    firsts = [t[0] for t in by_session.values()]
    shared = [r for r in firsts if r.hash_ids[0] == firsts[0].hash_ids[0]]
    assert len(shared) > 1
    # across sessions only a leading run (the system prompt's whole blocks) is shared, at equal positions
    where: dict[int, set[tuple[str, int]]] = {}
    for r in rows:
        for pos, h in enumerate(r.hash_ids):
            where.setdefault(h, set()).add((r.session_id, pos))
    for r in rows:
        crossed = [len({s for s, _ in where[h]}) > 1 for h in r.hash_ids]
        assert crossed == sorted(crossed, reverse=True)  # shared ids only before unshared ones
        for pos, h in enumerate(r.hash_ids):
            assert {p for _, p in where[h]} == {pos}


def test_equal_hash_ids_give_equal_token_prefixes_in_a_trace() -> None:
    rows = generate(TraceGenConfig(seed=1, block_size=32, num_sessions=10, system_median=100, user_median=40, output_median=20))
    c = BlockContent(32, seed=0)
    toks = [c.token_ids(r.hash_ids, r.input_length, i) for i, r in enumerate(rows)]
    for i in range(len(rows)):
        for j in range(i + 1, min(len(rows), i + 8)):
            a, b = rows[i].hash_ids, rows[j].hash_ids
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            n = min(common * 32, rows[i].input_length, rows[j].input_length)
            assert (toks[i][:n] == toks[j][:n]).all()
            if common < min(len(a), len(b)) and (common + 1) * 32 <= min(rows[i].input_length, rows[j].input_length):
                assert (toks[i][common * 32 : (common + 1) * 32] != toks[j][common * 32 : (common + 1) * 32]).any()


def test_trace_roundtrip_and_mooncake_workload(tmp_path) -> None:
    rows = generate(TraceGenConfig(seed=2, num_sessions=5))
    path = tmp_path / "t.jsonl"
    assert write_trace(path, rows) == len(rows)
    assert _same_rows(read_trace(path), rows)
    wl = make_workload(str(path))
    assert wl.name == "mooncake" and wl.timed and _same_rows(wl.rows, rows)
    wl = make_workload(f"mooncake:path={path},block_size=128", num_requests=3)
    assert wl.block_size == 128 and len(wl.rows) == 3
    # plain Mooncake rows (no session fields) load too
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    (row,) = read_trace(path)
    assert row.hash_ids == (1, 2) and row.session_id is None


def test_trace_stats_ideal_reuse() -> None:
    rows = [TraceRow(0, 1024, 1, (1, 2)), TraceRow(1, 1024, 1, (1, 3)), TraceRow(2, 1024, 1, (4, 2))]
    # blocks: (1) new, (1,2) new, (1) seen, (1,3) new, (4) new, (4,2) new: 1 of 6 reused
    assert trace_stats(rows, 512)["ideal_block_reuse"] == pytest.approx(1 / 6)


def test_parse_spec_and_errors() -> None:
    assert parse_spec("fixed:input_length=10,output_length=2") == ("fixed", {"input_length": "10", "output_length": "2"})
    assert parse_spec("/data/x.jsonl") == ("mooncake", {"path": "/data/x.jsonl"})
    with pytest.raises(ValueError):
        make_workload("nope")
    with pytest.raises(ValueError):
        make_workload("fixed:bogus=1")
    wl = make_workload("fixed:input_length=1500,output_length=3,shared_prefix=1024,block_size=256", 4)
    assert all(r.hash_ids[:4] == wl.rows[0].hash_ids[:4] for r in wl.rows)  # 4 whole shared blocks
    assert all(len(r.hash_ids) == 6 for r in wl.rows)
    assert len({r.hash_ids[4] for r in wl.rows}) == 4
    assert dataclasses.replace(TraceGenConfig(), mode="agent").mode == "agent"
