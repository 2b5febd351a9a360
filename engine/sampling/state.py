"""Per-request sampling state, and the per-request random stream.

Reproducibility rule: the random number that picks request r's token at output position ``step``
is a pure function of ``(seed_r, step)`` (a counter-based generator, splitmix64 finalisers), and
the distribution it is applied to depends only on r's own logits and state. So a seeded request
samples the same tokens whatever else shares the batch, in whatever order, and a request rebuilt
elsewhere from its output so far (migration, prefill -> decode handoff) continues the same stream.
One uniform per request and step is all the inverse-CDF sampler needs, so there is no per-request
``torch.Generator`` to seed and no vocabulary-sized noise to draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepserve.protocol import FinishReason, SamplingParams
from engine.sampling.structured import GrammarState

_M64 = (1 << 64) - 1

# Temperatures below this sample greedily (as vLLM does); dividing by them overflows.
GREEDY_EPS = 1e-5


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit hash with full avalanche."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def request_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) for (seed, step): 53 random bits of hash(hash(seed) ^ step)."""
    return (_mix64(_mix64(seed & _M64) ^ (step & _M64)) >> 11) * (1.0 / (1 << 53))


@dataclass(eq=False)
class SamplingState:
    """What the sampler keeps for one request between steps; the engine owns it, one per request.

    Create it with ``Sampler.new_state``; ``Sampler.sample`` advances it by one token per call.
    ``step`` is the number of output tokens sampled so far (the index of the next one).
    """

    params: SamplingParams
    seed: int  # params.seed, or one the sampler drew for an unseeded request
    grammar: GrammarState | None = None
    prompt_ids: torch.Tensor | None = None  # (P,) int64 distinct prompt ids; only with repetition penalty
    step: int = 0
    finish_reason: FinishReason | None = None
    reasoning_closed: bool = False  # ``params.reasoning_end_id`` was sampled (checked from the cap on)
    _out: torch.Tensor = field(default_factory=lambda: torch.empty(16, dtype=torch.int64), repr=False)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the logit values: no logprobs, penalties or grammar."""
        return (
            self.greedy and not self.params.logprobs and not self.has_penalties and not self.has_logit_rules
            and self.grammar is None
        )

    @property
    def has_logit_rules(self) -> bool:
        """A ``logit_bias``, ``min_tokens`` not yet reached, or the reasoning cap due (see
        ``penalties.apply_logit_rules``)."""
        return bool(self.params.logit_bias) or self.step < self.params.min_tokens or self.reasoning_due

    @property
    def reasoning_due(self) -> bool:
        """``max_reasoning_tokens`` output tokens are out and none was ``reasoning_end_id``: the
        reasoning must end now (that token is the only one allowed)."""
        p = self.params
        if p.max_reasoning_tokens is None or self.step < p.max_reasoning_tokens or self.reasoning_closed:
            return False
        if bool((self.output_ids() == p.reasoning_end_id).any()):  # once per request: then cached
            self.reasoning_closed = True
            return False
        return True

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_ids(self) -> torch.Tensor:
        """The output token ids so far, (step,) int64 (a view; do not keep it across steps)."""
        return self._out[: self.step]

    def uniform(self) -> float:
        """This step's uniform draw."""
        return request_uniform(self.seed, self.step)

    def record(self, token_id: int) -> bool:
        """Append one sampled token: output ids, grammar, step. False if the grammar rejected it."""
        if self.step == self._out.numel():
            grown = torch.empty(2 * self.step, dtype=torch.int64)
            grown[: self.step] = self._out
            self._out = grown
        self._out.numpy()[self.step] = token_id  # through numpy: ~20x cheaper than a tensor setitem
        self.step += 1
        return self.grammar is None or self.grammar.accept(token_id)

    @staticmethod
    def distinct_ids(token_ids: Sequence[int]) -> torch.Tensor:
        return torch.unique(torch.as_tensor(list(token_ids), dtype=torch.int64))
