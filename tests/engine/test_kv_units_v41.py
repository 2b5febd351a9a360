"""DeepSeek-V4.1 prefix resume through the KV store (engine/kv_units_v41.py): a prefix stored by
one request and resumed by another gives a cold run's greedy tokens and logprobs (fp32, CPU), on
the fixture checkpoints, through the memory tier and a real Redis-protocol server; the records
are DeepInfer's byte layout; blocks without a snapshot resume by replay; the fingerprint follows
every layout switch."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
import torch

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.backends.deepinfer.layout import cache_layout
from engine.kv_connector import KVConnector, snapshot_key
from engine.kv_units_v41 import V41Units
from engine.model.v41.config import V41Config
from engine.model.v41.loader import load_v41_model
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.tiny import random_v41_state_dict
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.sequence import Sequence
from kvstore import KVStoreConfig, build_store
from prometheus_client import CollectorRegistry
from tests.engine.model.v41.conftest import BAR, CASES, KNIFE_EDGE_BAR, fixture_case

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=CASES)
def case(request) -> tuple[str, object, dict]:
    ckpt, ref = fixture_case(request.param)
    return str(ckpt), load_v41_model(ckpt, dtype="float32"), ref


def _prompt(ref: dict, n: int, seed: int) -> list[int]:
    """``n`` tokens from the fixture's prompts and greedy outputs, in a seeded order."""
    pool = [t for p in ref["prompts"] for t in p["prompt_ids"] + p["greedy_tokens"]]
    rng = random.Random(seed)
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def _store(tiers=("memory",), **kw):
    return build_store(KVStoreConfig(tiers=tiers, **kw), registry=CollectorRegistry())


def _run(engine, rid: str, prompt: list[int], n: int = 16) -> tuple[list[int], list[float], int]:
    """Greedy ``n`` tokens: (tokens, chosen logprobs, cached prompt tokens)."""
    sampling = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=1)
    engine.add_request(GenerateRequest(rid, prompt, sampling))
    tokens, logprobs, cached = [], [], 0
    while engine.has_work():
        for ev in engine.step():
            assert ev.finish_reason != "error", ev.error
            tokens += ev.token_ids
            logprobs += [lp.logprob for lp in ev.logprobs or []]
            cached = max(cached, ev.num_cached_tokens)
    return tokens, logprobs, cached


def _engine(ckpt: str, model, store):
    return build_engine(ckpt, EngineConfig(), model=model, kv=KVConnector(store, model))


def _assert_same(got: tuple, cold: tuple) -> None:
    """The cold run's greedy tokens, logprobs within BAR. Two runs chunked differently may round a
    value on an FP8/FP4 midpoint to opposite sides where the CPU's BLAS sums the two chunkings in
    another order (seen under MKL's AVX2 kernels; not natively on AMD EPYC or an Intel AMX Xeon):
    then the logprobs stay within KNIFE_EDGE_BAR, and the tokens may part only at a near tie (the
    two picks' logprobs within KNIFE_EDGE_BAR), equal up to it."""
    assert len(got[0]) == len(cold[0])
    same = next((i for i, (a, b) in enumerate(zip(got[0], cold[0])) if a != b), len(got[0]))
    drift = max((abs(a - b) for a, b in zip(got[1][:same], cold[1][:same])), default=0.0)
    if same == len(got[0]) and drift <= BAR:
        return
    assert drift <= KNIFE_EDGE_BAR, (same, drift)
    if same < len(got[0]):
        assert abs(got[1][same] - cold[1][same]) <= KNIFE_EDGE_BAR, f"the runs part at step {same}, no near tie"


def test_stored_prefix_resumes_exactly(case) -> None:
    """Request 1 stores its prompt's units; request 2 (same prefix, then its own turn) resumes
    from them and gives what a cold engine gives; a third repeats request 1 and hits too."""
    ckpt, model, ref = case
    first = _prompt(ref, 200, 1)
    engine = _engine(ckpt, model, _store())
    out1 = _run(engine, "a", first)
    second = first + out1[0] + _prompt(ref, 70, 2)  # 286 tokens: resumes at the snapshot after 128
    got = _run(engine, "b", second)
    assert got[2] == 128  # request 1 computed 216 tokens: its prompt's snapshot is the one after 128
    _assert_same(got, _run(_engine(ckpt, model, _store()), "cold", second))
    again = _run(engine, "c", first)
    assert again[2] == 128
    _assert_same(again, out1)


def test_shared_prefix_without_a_snapshot_replays_exactly(case) -> None:
    """Two prompts share 2 units whose snapshot is gone: the second loads the shared blocks and
    replays from the unit boundary ``layers × (W-1)`` tokens before their end (its windows
    refill, its compressors skip the rows they hold) to the cold tokens and logprobs."""
    ckpt, model, ref = case
    cfg = model.config
    assert cfg.num_hidden_layers * (cfg.sliding_window - 1) <= 128  # the fixtures: one unit of replay suffices
    first = _prompt(ref, 300, 6)  # computed as [0, 256) + the rest, as the cold second prompt is
    engine = _engine(ckpt, model, _store())
    _run(engine, "a", first, n=2)
    assert engine.kv.store.remove(snapshot_key(engine.kv.keys(first[:256])[-1]))
    second = first[:256] + _prompt(ref, 100, 7)
    got = _run(engine, "b", second)
    assert got[2] == 128
    _assert_same(got, _run(_engine(ckpt, model, _store()), "cold", second))


@pytest.mark.redis
def test_prefix_resumes_from_redis(case, redis_server) -> None:
    """Another engine (a fresh store client, as another process) resumes from Redis."""
    ckpt, model, ref = case
    cfg = dict(redis_url=redis_server.url, redis_prefix=f"v41-{random.random()}")
    prompt = _prompt(ref, 300, 3)
    cold = _run(_engine(ckpt, model, _store(("redis",), **cfg)), "a", prompt)
    got = _run(_engine(ckpt, model, _store(("redis",), **cfg)), "b", prompt)
    assert got[2] == 256
    _assert_same(got, cold)


def _stored(model, prompt: list[int], upto: int = 256) -> KVConnector:
    """A connector whose memory store holds ``prompt[:upto]``'s units and the snapshot after them."""
    conn = KVConnector(_store(), model)
    seq = Sequence(request=GenerateRequest("s", prompt), sampling=None, tokens=list(prompt), num_prompt=len(prompt))  # type: ignore[arg-type]
    seq.state = model.new_state()
    model([(seq.state, prompt[:upto])])
    seq.num_computed = seq.snapshot_at = upto
    conn.save(seq, model)
    return conn


def test_records_are_deepinfers_layout(case) -> None:
    """Blocks: only the KV-source layers' FP4 rows, one GPU block's regions; the snapshot: every
    layer's FP8 window ring, the engram history, the token count."""
    _, model, ref = case
    cfg, prompt = model.config, _prompt(ref, 260, 4)
    conn = _stored(model, prompt)
    keys = conn.keys(prompt[:256])
    layout = cache_layout(cfg)
    for key in keys:
        block = conn.store.get(key)
        assert {n: tuple(t.shape) for n, t in block.tensors.items()} == {r.tensor_name: (r.rows, r.row_bytes) for r in layout.regions}
        assert all(t.dtype == torch.uint8 for t in block.tensors.values()) and block.nbytes == layout.block_data_bytes
    snap = conn.store.get(snapshot_key(keys[-1]))
    assert tuple(snap.tensors["windows"].shape) == (cfg.num_hidden_layers, cfg.sliding_window - 1, layout.swa_row_bytes)
    assert snap.header.meta["tokens"] == 256 and snap.header.token_end == 256
    want_engram = model.hasher.history(prompt[:256]) if model.hasher is not None else []
    assert snap.tensors["engram"].tolist() == want_engram


def test_a_snapshot_that_does_not_fit_is_a_miss(case) -> None:
    """A snapshot whose windows do not fit the model restores nothing (a miss, never a wrong state)."""
    _, model, ref = case
    prompt = _prompt(ref, 260, 5)
    conn = _stored(model, prompt)
    key = snapshot_key(conn.keys(prompt[:256])[-1])
    snap = conn.store.get(key)
    bad = dict(snap.tensors)
    bad["windows"] = bad["windows"][:, 1:]  # one ring row short
    conn.store.remove(key)
    assert conn.store.put(key, snap.header, bad)
    seq = Sequence(request=GenerateRequest("q", prompt), sampling=None, tokens=list(prompt), num_prompt=len(prompt))  # type: ignore[arg-type]
    conn.restore(seq, model)
    assert seq.state is None and seq.num_computed == 0


def test_fingerprint_covers_every_layout_switch() -> None:
    """Window, ratios, index sources, candidate source, indexer width, dtype and the engram
    tokenizer each change the fingerprint (and hence every key); equal models agree."""
    base = load_v41_model(fixture_case("tester")[0], dtype="float32").config
    fp = lambda cfg, dtype=torch.float32: V41Units(DeepseekV41ForCausalLM(cfg, dtype)).fingerprint  # noqa: E731
    variants = [
        replace(base, sliding_window=base.sliding_window * 2),
        replace(base, compress_ratios=tuple(1 if r == 2 else r for r in base.compress_ratios)),
        replace(base, index_source_layer_ids=(1, 2, 3)),
        replace(base, candidate_source_layer_id=-1),
        replace(base, index_topk=base.index_topk + 1),
    ]
    prints = {fp(base)} | {fp(v) for v in variants} | {fp(base, torch.bfloat16)}
    assert len(prints) == len(variants) + 2 and fp(base) == fp(replace(base))
    ckpt, _ = fixture_case("engram")
    engram = load_v41_model(ckpt, dtype="float32")
    other = replace(engram.hasher, token_map=engram.hasher.token_map.flip(0))
    assert V41Units(engram).fingerprint != V41Units(DeepseekV41ForCausalLM(engram.config, torch.float32, other)).fingerprint


def test_shapes_without_a_record_format_turn_the_store_off() -> None:
    """A head_dim the model leaves unquantised (not whole 32-blocks) has no record format: the
    engine serves with ``kv_cache="off"`` instead of failing."""
    from engine.kv_units_v41 import unsupported
    from engine.runtime.builder import family_engine_config

    base = load_v41_model(fixture_case("tester")[0], dtype="float32").config
    odd = replace(base, head_dim=40, qk_rope_head_dim=8)
    assert unsupported(base) is None and "head_dim 40" in unsupported(odd)
    assert family_engine_config(DeepseekV41ForCausalLM(odd), EngineConfig()).kv_cache == "off"
    assert family_engine_config(DeepseekV41ForCausalLM(base), EngineConfig()).kv_cache == "readwrite"


HELD_OUT = V41Config(
    vocab_size=300, hidden_size=64, num_hidden_layers=6, num_attention_heads=2, head_dim=128, q_lora_rank=32,
    qk_rope_head_dim=16, max_position_embeddings=4096, sliding_window=200, compress_ratios=(0, 2, 2, 1, 1, 1),
    kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3, candidate_topk_blocks=4,
    candidate_block_size=4, index_n_heads=4, index_head_dim=64, index_topk=8, o_groups=2, o_lora_rank=16,
    moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=3,
    num_nextn_predict_layers=0,
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_shapes_resume_exactly(dtype: torch.dtype) -> None:
    """A random model of another shape (head_dim 128, indexer 64, a window of 200 that one unit
    does not fill, a reindexing source after the candidate source), in fp32 and bf16: resuming
    after 1 or 5 units gives the cold logits of every following token bit for bit."""
    model = DeepseekV41ForCausalLM(HELD_OUT, dtype)
    names = {re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2", k): v for k, v in random_v41_state_dict(model, 3).items()}
    model.load_state_dict(names)
    rng = random.Random(0)
    assert_resumes_exactly(model, [rng.randrange(HELD_OUT.vocab_size) for _ in range(700)], (128, 640))


def assert_resumes_exactly(model: DeepseekV41ForCausalLM, prompt: list[int], uptos: tuple[int, ...]) -> None:
    """For each ``upto``: a sequence restored from a store holding ``prompt[:upto]`` computes the
    rest of the prompt with the cold logits of every token, bit for bit."""
    for upto in uptos:
        conn = _stored(model, prompt, upto)
        seq = Sequence(request=GenerateRequest("q", prompt), sampling=None, tokens=list(prompt), num_prompt=len(prompt))  # type: ignore[arg-type]
        conn.restore(seq, model)
        assert seq.num_computed == upto
        st = model.new_state()
        model([(st, prompt[:upto])])
        cold = model([(st, prompt[upto:])], logits="all")
        assert torch.equal(model([(seq.state, prompt[upto:])], logits="all"), cold)
