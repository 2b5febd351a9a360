"""Drive an EngineCore to completion and collect its output per request."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.engine_core import EngineCore


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
