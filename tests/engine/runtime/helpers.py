"""Drive an EngineCore to completion and collect its output per request."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from prometheus_client import CollectorRegistry

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.kv_connector import KVConnector
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig, SpeculativeConfig
from engine.runtime.engine_core import EngineCore
from engine.runtime.metrics import EngineMetricFamilies, EngineMetrics
from kvstore import KVStoreConfig, build_store

SPEC_LABELS = {"model_name": "m", "dp_rank": "0", "engine": "0"}  # spec_engine's metric labels


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cached: int = 0


def run(engine: EngineCore, requests: list[GenerateRequest], max_steps: int = 10_000) -> dict[str, Result]:
    out: dict[str, Result] = {r.request_id: Result() for r in requests}
    for r in requests:
        engine.add_request(r)
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for ev in engine.step():
            res = out[ev.request_id]
            res.tokens += ev.token_ids
            res.logprobs += [lp.logprob for lp in ev.logprobs or []]
            res.cached = max(res.cached, ev.num_cached_tokens)
            if ev.finished:
                res.finish_reason = ev.finish_reason
    assert not engine.has_work(), "engine did not finish"
    return out


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 129280) for _ in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2, **kw)


def spec_engine(ckpt, model, spec: SpeculativeConfig | None, **kw) -> tuple[EngineCore, CollectorRegistry]:
    """An engine of ``model`` (speculative with ``spec``, or not; ``max_num_seqs`` 8 unless
    given) and the registry of its metrics."""
    reg = CollectorRegistry()
    kw.setdefault("max_num_seqs", 8)
    engine = build_engine(ckpt, EngineConfig(speculative=spec, **kw), model=model, metrics=EngineMetrics(EngineMetricFamilies(reg), "m", 0))
    return engine, reg


def spec_counts(reg: CollectorRegistry, positions: int) -> dict[str, float]:
    """``spec_engine``'s ``vllm:spec_decode_*`` counters; ``per_pos``: the accepted tokens summed
    over the first ``positions`` draft positions."""
    value = lambda name, **kw: reg.get_sample_value(f"vllm:spec_decode_{name}_total", {**SPEC_LABELS, **kw}) or 0.0  # noqa: E731
    out = {n: value(n) for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    out["per_pos"] = sum(value("num_accepted_tokens_per_pos", position=str(p)) for p in range(positions))
    return out


EngineFor = Callable[..., tuple[EngineCore, CollectorRegistry]]  # (k or None, **EngineConfig fields) → engine, registry


def check_seeded_sampling(engine_for: EngineFor, text: list[int], temperature: float, seeds: int, k: int, positions: int, distinct: int) -> None:
    """Rejection sampling with deterministic drafts, each verify row sampled with its own
    ``(seed, step)`` uniform: ``seeds`` seeded requests of ``text`` with ``k`` drafts give per seed
    the very tokens (and logprobs) of the plain sampler, so the same distribution; penalties,
    logit bias, ``min_tokens``, top-p and logprobs ride along. At temperature 1 the language
    dominates (drafts mostly accepted); above it more than ``distinct`` different outputs (the
    seeds really sample, drafts often rejected)."""
    extra = [
        dict(logprobs=True, top_logprobs=2), dict(repetition_penalty=1.3, presence_penalty=0.5), dict(top_p=0.9),
        dict(min_tokens=4, logit_bias=((1030, 2.0),)),
    ]  # fmt: skip
    # top_k: a draw over 40 candidates, not the near-uniform 129k a high temperature makes of a tiny
    # model's random rows (there a logit's last-bit rounding, which differs with the batch in any
    # engine, moves a CDF boundary by a sizeable share of a token's width)
    params = [SamplingParams(max_tokens=12, temperature=temperature, top_k=40, seed=s, ignore_eos=True, **extra[s % 4]) for s in range(seeds)]
    reqs = lambda: [GenerateRequest(f"f{i}", text, p) for i, p in enumerate(params)]  # noqa: E731
    base = run(engine_for(None)[0], reqs())
    engine, reg = engine_for(k, max_num_seqs=seeds)
    out = run(engine, reqs())
    assert {r: o.tokens for r, o in out.items()} == {r: o.tokens for r, o in base.items()}
    for r, o in out.items():  # the same log-probabilities, up to the batch's float rounding
        assert o.logprobs == pytest.approx(base[r].logprobs, rel=1e-5, abs=1e-4)
    c = spec_counts(reg, positions)
    assert c["num_draft_tokens"] > 0
    if temperature == 1.0:
        assert c["num_accepted_tokens"] > 0.5 * c["num_draft_tokens"], c
    else:
        assert len({tuple(o.tokens) for o in base.values()}) > distinct


def check_opted_out_never_drafted(engine_for: EngineFor, text: list[int], k: int) -> None:
    """A request with ``speculative=False`` on a speculative engine: the plain tokens, no drafts."""
    req = GenerateRequest("o", text, SamplingParams(max_tokens=12, temperature=0.0, speculative=False, ignore_eos=True))
    base = run(engine_for(None)[0], [req])
    engine, reg = engine_for(k)
    assert run(engine, [GenerateRequest.from_dict(req.to_dict())])["o"].tokens == base["o"].tokens
    assert spec_counts(reg, k)["num_drafts"] == 0


def memory_kv(model) -> KVConnector:
    """A KV connector over a fresh memory tier, decode snapshots every unit, its load-or-recompute
    cost model kept at its conservative start: the model learns this box's prefill speed, and
    where the tiny model prefills fast enough it (rightly) recomputes instead of loading, which
    made tests that expect store hits depend on the machine (a CI run saw a preempted sequence
    come back from token 0). Loading then always wins; what these tests check is the resume."""
    kv = KVConnector(build_store(KVStoreConfig(tiers=("memory",)), registry=CollectorRegistry()), model, snapshot_interval_units=1)
    kv.observe_prefill = lambda tokens, seconds: None
    return kv


def check_kv_resume_stays_exact(engine_for: EngineFor, model, k: int, acceptance: float) -> None:
    """Each turn of a conversation hits the 128-token units the previous speculative turn stored
    (units saved once their tokens were accepted; drafts stop at unit boundaries) and gives the
    tokens of a cold engine without speculation; more than ``acceptance`` of the drafts accepted."""
    from engine.model.tiny_mtp import TrainConfig, sentence

    engine, reg = engine_for(k)
    engine.kv = memory_kv(model)
    cold = engine_for(None)[0]
    lang = TrainConfig()
    conversation = prompt(101, 11) + sentence(lang, 1005, 8)  # 109 + (k + 1)j never lands on 128 unclamped
    computed_before = 0
    for turn in range(3):
        req = lambda rid: GenerateRequest(rid, list(conversation), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))  # noqa: E731
        got, want = run(engine, [req(f"t{turn}")])[f"t{turn}"], run(cold, [req(f"c{turn}")])[f"c{turn}"]
        assert got.tokens == want.tokens, turn
        if turn:
            assert got.cached >= (computed_before // 128) * 128 > 0
        computed_before = len(conversation) + len(got.tokens) - 1
        conversation += got.tokens + prompt(20, 100 + turn) + sentence(lang, 1010 + turn, 4)
    c = spec_counts(reg, k)
    assert c["num_accepted_tokens"] > acceptance * c["num_draft_tokens"] > 0, c


def check_preemption_resumes_exactly(engine_for: EngineFor, model, k: int) -> None:
    """A state budget too small for every sequence (5 units for 4 × 2) preempts some (state and
    drafts dropped, recomputed from the tokens later); the tokens stay those of the plain engine."""
    from engine.model.tiny_mtp import TrainConfig, sentence
    from engine.runtime.state_pool import state_bytes

    lang = TrainConfig()
    reqs = lambda: [GenerateRequest(f"p{i}", prompt(n, 50 + i) + sentence(lang, 1000 + i, 4), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i, n in enumerate((116, 126, 121, 136))]  # noqa: E731
    base = run(engine_for(None)[0], reqs())
    block, boundary = state_bytes(model.config, model.dtype)
    engine, _ = engine_for(k, max_num_seqs=4, state_memory_bytes=4 * boundary + 5 * block)
    out = run(engine, reqs())
    assert engine.scheduler.num_preemptions > 0
    assert {r: o.tokens for r, o in out.items()} == {r: o.tokens for r, o in base.items()}
