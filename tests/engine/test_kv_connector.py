"""Prefix reuse through the KV store is exact (fp32, CPU): a hit continues with the cold run's logits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.kv_connector import KVConnector, snapshot_key
from engine.model.loader import load_model
from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.sequence import Sequence
from kvstore import KVStoreConfig, build_store
from prometheus_client import CollectorRegistry

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def small(small_windows_model_dir):
    return load_model(small_windows_model_dir, dtype="float32", progress=False)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 129280) for _ in range(n)]


def _store(tiers=("memory",), **kw):
    return build_store(KVStoreConfig(tiers=tiers, **kw), registry=CollectorRegistry())


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(request=GenerateRequest("s", tokens), sampling=None, tokens=list(tokens), num_prompt=len(tokens))  # type: ignore[arg-type]


def _fill(conn: KVConnector, model, tokens: list[int], upto: int) -> None:
    """Compute ``tokens[:upto]`` (a whole number of units) and store its units and snapshot."""
    seq = _seq(tokens)
    seq.state = model.new_state()
    model([(seq.state, tokens[:upto])])
    seq.num_computed = upto
    seq.snapshot_at = upto
    conn.save(seq, model)


def _resume_logits(conn: KVConnector, model, tokens: list[int]) -> tuple[torch.Tensor, int]:
    seq = _seq(tokens)
    conn.restore(seq, model)
    state = seq.state or model.new_state()
    return model([(state, tokens[seq.num_computed :])])[0], seq.num_computed


def _cold(model, tokens: list[int]) -> torch.Tensor:
    """The engine's cold path: with KV writes on, a prefill chunk ends at the prompt's last whole
    unit (so that unit's snapshot can be stored), then the rest follows."""
    st = model.new_state()
    aligned = ((len(tokens) - 1) // 128) * 128
    if aligned:
        model([(st, tokens[:aligned])])
    return model([(st, tokens[aligned:])])[0]


def test_hit_at_snapshot_is_exact(tiny) -> None:
    conn = KVConnector(_store(), tiny)
    base = _tokens(300, 1)
    _fill(conn, tiny, base, 256)
    query = base + _tokens(40, 2)
    got, resumed_at = _resume_logits(conn, tiny, query)
    assert resumed_at == 256
    assert (got - _cold(tiny, query)).abs().max().item() <= TOL


@pytest.mark.parametrize("model_name,prompt_len", [("small", 300), ("tiny", 700)])
def test_hit_on_blocks_only_replays_exactly(request, model_name, prompt_len) -> None:
    """With the snapshot gone, blocks + a replay of layers × (W-1) tokens give the same logits."""
    model = request.getfixturevalue(model_name)
    store = _store()
    conn = KVConnector(store, model)
    base = _tokens(prompt_len, 3)
    upto = (prompt_len // 128) * 128
    _fill(conn, model, base, upto)
    keys = conn.keys(base[:upto])
    assert store.remove(snapshot_key(keys[-1]))
    query = base + _tokens(20, 4)
    got, resumed_at = _resume_logits(conn, model, query)
    assert 0 < resumed_at == conn.units.replay_start(len(keys) * conn.unit) < upto
    assert (got - _cold(model, query)).abs().max().item() <= TOL


def test_bounded_replay_is_refused_for_v4(small) -> None:
    """Bounded replay bounds V4.1's decoder layers (tests/engine/test_kv_units_v41_bounded.py);
    V4 has none, so asking for it is an error rather than a silent exact replay."""
    with pytest.raises(ValueError, match="DeepSeek-V4 has none"):
        KVConnector(_store(), small, bounded_replay_tokens=16)


@pytest.mark.parametrize("tier", ["ssd", "fs"])
def test_round_trip_through_disk_tier(tiny, tmp_path: Path, tier: str) -> None:
    conn = KVConnector(_store((tier,), **{f"{tier}_dir": str(tmp_path)}), tiny)
    base = _tokens(260, 6)
    _fill(conn, tiny, base, 256)
    conn2 = KVConnector(_store((tier,), **{f"{tier}_dir": str(tmp_path)}), tiny)  # a fresh process's view
    got, resumed_at = _resume_logits(conn2, tiny, base)
    assert resumed_at == 256
    assert (got - _cold(tiny, base)).abs().max().item() <= TOL


@pytest.mark.redis
def test_round_trip_through_redis(tiny, redis_server) -> None:
    cfg = dict(redis_url=redis_server.url, redis_prefix=f"t{random.random()}")
    conn = KVConnector(_store(("redis",), **cfg), tiny)
    base = _tokens(300, 7)
    _fill(conn, tiny, base, 256)
    got, resumed_at = _resume_logits(KVConnector(_store(("redis",), **cfg), tiny), tiny, base)
    assert resumed_at == 256
    assert (got - _cold(tiny, base)).abs().max().item() <= TOL


def _run(engine, rid: str, prompt: list[int], n: int = 12) -> tuple[list[int], int]:
    engine.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
    tokens, cached = [], 0
    while engine.has_work():
        for ev in engine.step():
            assert ev.finish_reason != "error", ev.error
            tokens += ev.token_ids
            cached = max(cached, ev.num_cached_tokens)
    return tokens, cached


@pytest.fixture(scope="module")
def cold_conversation(tiny, tiny_model_dir) -> list[tuple[list[int], list[int]]]:
    """The five turns' ``(prompt, tokens)`` of a cold engine (no KV store): each prompt is the
    previous one, its 40 tokens and 30 new ones. Computed once for both parametrisations of the
    test below (the same cold engine, prompts and tokens either way)."""
    cold = build_engine(tiny_model_dir, model=tiny)
    prompt, turns = _tokens(150, 8), []
    for turn in range(5):
        out = _run(cold, f"c{turn}", prompt, n=40)[0]
        turns.append((prompt, out))
        prompt = prompt + out + _tokens(30, 100 + turn)
    return turns


@pytest.mark.parametrize("static", [False, True], ids=["general", "static-runner"])
def test_multi_turn_conversation_hits_previous_turn(tiny, tiny_model_dir, cold_conversation, static: bool) -> None:
    """Each turn hits the units the previous turn stored (prompt and decode units; with the
    static runner, decode units come from states its slots hand back) and gives the cold tokens."""
    engine = build_engine(tiny_model_dir, EngineConfig(static_decode=static, static_max_tokens=1024), model=tiny)
    engine.kv = KVConnector(_store(), tiny)
    computed_before = 0  # tokens whose state the previous turn computed
    for turn, (prompt, cold_out) in enumerate(cold_conversation):
        out, cached = _run(engine, f"t{turn}", prompt, n=40)
        assert out == cold_out
        if turn:
            assert cached >= (computed_before // 128) * 128 > 0
        computed_before = len(prompt) + len(out) - 1
    assert (engine.static is not None and engine.static.steps > 0) == static


def test_corrupt_record_on_disk_is_a_miss(tiny, tiny_model_dir, tmp_path: Path) -> None:
    engine = build_engine(tiny_model_dir, model=tiny)
    engine.kv = KVConnector(_store(("ssd",), ssd_dir=str(tmp_path)), tiny)
    prompt = _tokens(270, 9)
    first, _ = _run(engine, "a", prompt)
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
    again, cached = _run(engine, "b", prompt)
    assert again == first and cached == 0


def test_full_ssd_budget_evicts_and_still_serves(tiny, tiny_model_dir, tmp_path: Path) -> None:
    engine = build_engine(tiny_model_dir, model=tiny)
    engine.kv = KVConnector(_store(("ssd",), ssd_dir=str(tmp_path), ssd_bytes=120_000), tiny)
    cold = build_engine(tiny_model_dir, model=tiny)
    for i in range(4):
        prompt = _tokens(260, 20 + i)
        assert _run(engine, f"f{i}", prompt)[0] == _run(cold, f"g{i}", prompt)[0]
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= 120_000


@pytest.mark.redis
def test_redis_killed_mid_use_serves_misses(tiny, tiny_model_dir, redis_server) -> None:
    registry = CollectorRegistry()
    store = build_store(KVStoreConfig(tiers=("redis",), redis_url=redis_server.url, redis_prefix="kill"), registry=registry)
    engine = build_engine(tiny_model_dir, model=tiny)
    engine.kv = KVConnector(store, tiny)
    prompt = _tokens(260, 30)
    first, _ = _run(engine, "a", prompt)
    redis_server.kill()
    try:
        again, cached = _run(engine, "b", prompt)
        assert again == first and cached == 0
        errors = sum(s.value for m in registry.collect() if m.name == "deepserve_kvstore_errors" for s in m.samples if s.name.endswith("_total"))
        assert errors >= 1
    finally:
        redis_server.restart()


def test_slow_kv_load_overlaps_other_requests(tiny, tiny_model_dir) -> None:
    """While one request's prefix loads from a slow store, other requests keep being served."""
    import threading
    import time

    engine = build_engine(tiny_model_dir, model=tiny)
    engine.kv = KVConnector(_store(), tiny)
    long_prompt = _tokens(300, 40)
    expected, _ = _run(engine, "warm", long_prompt)  # stores the prompt's units
    release = threading.Event()
    real_get_many = engine.kv.store.get_many

    def slow_get_many(keys, **kw):
        release.wait(10)  # a store that answers only when the test says so
        return real_get_many(keys, **kw)

    engine.kv.store.get_many = slow_get_many
    engine.add_request(GenerateRequest("slow", long_prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    engine.add_request(GenerateRequest("fast", _tokens(20, 41), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    done: dict[str, list[int]] = {"slow": [], "fast": []}
    cached = 0
    deadline = time.monotonic() + 60
    while engine.has_work() and time.monotonic() < deadline:
        for ev in engine.step():
            done[ev.request_id] += ev.token_ids
            cached = max(cached, ev.num_cached_tokens if ev.request_id == "slow" else 0)
            if ev.request_id == "fast" and ev.finished:
                assert not done["slow"], "the slow load should still be pending"
                release.set()
    assert len(done["fast"]) == 5 and done["slow"] == expected and cached == 256


@pytest.mark.parametrize("interval, due", [(0, [False, True, False, False]), (1, [True] * 4), (2, [False, True, False, True])])
def test_snapshot_interval_zero_is_off(tiny, interval: int, due: list[bool]) -> None:
    """Decode units are saved every ``interval`` units; 0 saves only the prompt's last unit."""
    conn = KVConnector(_store(), tiny, snapshot_interval_units=interval)
    seq = _seq(_tokens(300, 3))
    seq.snapshot_at = 256
    for n, want in zip((128, 256, 384, 512), due):
        seq.num_computed = n
        assert conn.save_due(seq) == want, n
    with pytest.raises(ValueError):
        KVConnector(_store(), tiny, snapshot_interval_units=-1)


def test_saved_units_are_announced_for_the_connectors_rank(tiny) -> None:
    store = _store()
    conn = KVConnector(store, tiny, dp_rank=3)
    _fill(conn, tiny, _tokens(300, 4), 256)
    events = store.events.since(0).events
    assert events and {e.dp_rank for e in events} == {3}
