"""Drive an EngineCore to completion and collect its output per request."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig, SpeculativeConfig
from engine.runtime.engine_core import EngineCore
from engine.runtime.metrics import EngineMetricFamilies, EngineMetrics

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
