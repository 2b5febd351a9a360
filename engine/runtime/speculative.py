"""Speculative decoding with the checkpoint's MTP layer: draft ``k``, verify in one forward, rewind.

Which requests: greedy ones with nothing that needs logit values (no logprobs, penalties, logit
bias or ``min_tokens`` rules, grammar, prompt logprobs), not prefill-only, not opted out
(``SamplingParams.speculative``). Every other request decodes as without speculation, so output
never depends on it; an eligible request's tokens are the greedy tokens of the target model.

A speculative sequence runs on the general path (never a static slot), every step:

1. its chunk: prefill tokens, or the next token ``t`` plus the drafts ``d_1..d_m`` (``m ≤ k``, as the
   scheduler's budget allows); before a verify the state is marked (``engine/model/rewind.py``);
2. one forward for all speculative chunks, returning every row's final streams;
3. a sequence at its end takes the exact greedy token of each row from ``t`` on: ``g_0..g_m``;
   accepted = the longest prefix with ``d_j == g_{j-1}``, ``a`` drafts; the tokens ``g_0..g_a``
   are recorded one by one (stop tokens, EOS and ``max_tokens`` end the run where they occur), the
   state is rewound to ``t, d_1..d_a``;
4. the MTP layer is fed the consumed rows (streams of row ``p``, token ``p + 1``) and proposes the
   next ``k`` drafts from the last one.

With a KV store, drafts never reach past the next 128-token unit boundary, so a sequence always
lands exactly on it once and the boundary snapshot is taken there, after acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepserve.protocol import FinishReason
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.mtp import Drafter, MTPLayer
from engine.model.rewind import Mark, mark, rewind
from engine.runtime.config import SpeculativeConfig
from engine.runtime.sequence import Sequence
from engine.sampling import Sampler


@dataclass
class SpecResult:
    """One sequence's outcome of a speculative step."""

    consumed: int  # tokens now in the state (add to ``num_computed``)
    tokens: list[int] = field(default_factory=list)  # new output tokens (empty: a prefill chunk)
    finish_reason: FinishReason | None = None
    drafted: int = 0  # drafts verified this step
    accepted: int = 0  # of which accepted


class SpecDecoder:
    """Drafts and verifies for the engine core (module docstring)."""

    def __init__(self, model: DeepseekV4ForCausalLM, sampler: Sampler, config: SpeculativeConfig, unit_tokens: int | None) -> None:
        self.model, self.sampler, self.config = model, sampler, config
        self.k = config.num_speculative_tokens
        self.drafter = Drafter(model, MTPLayer.from_model(model))
        self.unit = unit_tokens  # clamp drafts at these boundaries (a KV store saves there); None: no clamp
        if self.k + 1 > model.config.sliding_window - 1:
            raise ValueError("num_speculative_tokens + 1 must be below the sliding window")

    @staticmethod
    def takes(seq: Sequence) -> bool:
        """Whether ``seq`` decodes speculatively (fixed per request: module docstring)."""
        req = seq.request
        p = req.sampling
        return (
            seq.sampling is not None and p.speculative and not req.prefill_only and p.prompt_logprobs is None
            and p.temperature == 0.0 and not p.logprobs and not p.logit_bias and p.min_tokens == 0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            and p.constraint is None
        )  # fmt: skip

    @torch.inference_mode()
    def step(self, batch: list[tuple[Sequence, int]]) -> list[SpecResult]:
        """Run ``batch`` (each sequence with its scheduled token count) through steps 1-4."""
        chunks, marks, fed = [], [], []
        for seq, n in batch:
            if seq.state is None:  # new, or preempted: a fresh main state and MTP window
                seq.state, seq.draft, seq.draft_ids = self.model.new_state(), None, []
            real = min(n, seq.remaining)
            drafts = self._clamp(seq, seq.draft_ids[: n - real]) if real == seq.remaining else []
            ids = seq.tokens[seq.num_computed : seq.num_computed + real] + drafts
            marks.append(mark(seq.state) if drafts else None)
            fed.append((real, drafts))
            chunks.append((seq.state, ids))
        streams = self.model(chunks, logits="streams")  # (N, hc, H)
        targets = self._greedy_rows(batch, fed, streams)
        results, feeds, ends = [], [], []
        start = 0
        for (seq, _), (real, drafts), m, g in zip(batch, fed, marks, targets):
            res = self._accept(seq, real, drafts, m, g)
            rows = streams[start : start + res.consumed]  # (consumed, hc, H): the rows now in the state
            first = seq.num_computed
            feeds.append((seq, rows, seq.tokens[first + 1 : first + res.consumed + 1], first))
            if g is not None and res.finish_reason is None:
                ends.append(len(feeds) - 1)
            start += real + len(drafts)
            results.append(res)
        self._draft(feeds, ends)
        return results

    def _clamp(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """``drafts`` cut so the verify ends at the next unit boundary at the latest."""
        if self.unit is None:
            return drafts
        boundary = (seq.num_computed // self.unit + 1) * self.unit
        return drafts[: max(0, boundary - seq.num_computed - 1)]

    def _greedy_rows(self, batch: list[tuple[Sequence, int]], fed: list[tuple[int, list[int]]], streams: torch.Tensor) -> list[list[int] | None]:
        """Each sequence at its end: the exact greedy token after its last real token and after
        each draft (``1 + m``); None for a prefill chunk that does not reach the end."""
        rows: list[int] = []
        spans: list[tuple[int, int] | None] = []
        start = 0
        for (seq, _), (real, drafts) in zip(batch, fed):
            if seq.num_computed + real < len(seq.tokens):
                spans.append(None)
            else:
                spans.append((len(rows), len(rows) + 1 + len(drafts)))
                rows.extend(range(start + real - 1, start + real + len(drafts)))
            start += real + len(drafts)
        if not rows:
            return [None] * len(batch)
        idx = torch.tensor(rows, device=streams.device)
        tokens = self.model.head.argmax(self.model.final_hidden(streams.index_select(0, idx))).tolist()
        return [None if s is None else [int(t) for t in tokens[s[0] : s[1]]] for s in spans]

    def _accept(self, seq: Sequence, real: int, drafts: list[int], m: Mark | None, targets: list[int] | None) -> SpecResult:
        """Step 3 for one sequence; appends its new tokens to ``seq.tokens``."""
        if targets is None:
            return SpecResult(consumed=real)
        assert seq.sampling is not None
        a = 0
        while a < len(drafts) and drafts[a] == targets[a]:
            a += 1
        res = SpecResult(consumed=real, drafted=len(drafts), accepted=a)
        for t in targets[: a + 1]:
            res.tokens.append(t)
            seq.tokens.append(t)
            res.finish_reason = self.sampler.advance(seq.sampling, t)
            if res.finish_reason is not None:
                break
        res.consumed += len(res.tokens) - 1  # the accepted drafts before the last new token
        if m is not None:
            assert seq.state is not None
            rewind(self.model, seq.state, m, res.consumed)
        return res

    def _draft(self, feeds: list[tuple[Sequence, torch.Tensor, list[int], int]], ends: list[int]) -> None:
        """Step 4: feed the consumed rows to each MTP window; new drafts for the sequences at their end."""
        live = [f for f in feeds if f[1].shape[0] and len(f[2]) == f[1].shape[0]]
        for seq, *_ in feeds:
            seq.draft_ids = []
        if not live:
            return
        for seq, *_ in live:
            if seq.draft is None:
                seq.draft = self.drafter.new_state()
        last = self.drafter.feed([s.draft for s, *_ in live], [r for _, r, _, _ in live], [t for *_, t, _ in live], [p for *_, p in live])
        want = {id(feeds[i][0]) for i in ends}
        pick = [j for j, f in enumerate(live) if id(f[0]) in want]
        if not pick:
            return
        seqs = [live[j][0] for j in pick]
        drafts = self.drafter.propose([s.draft for s in seqs], last[torch.tensor(pick, device=last.device)], self.k)
        for seq, d in zip(seqs, drafts):
            seq.draft_ids = d
