"""Speculative decoding with the checkpoint's own draft layers: draft ``k``, verify in one forward, rewind.

Two families, one accept/sample logic: the family's target (``engine/runtime/spec_targets.py``)
runs the verify forward, gives the head rows, rewinds and drafts — DeepSeek-V4 with its MTP layer
(``method="mtp"``), DeepSeek-V4.1 with its DSpark draft layers (``method="dspark"``: a block of up
to ``dspark_block_size`` drafts, optionally cut by the confidence head, ``confidence_threshold``).

Which requests: all but prefill-only ones, those asking for prompt logprobs, and those opted out
(``SamplingParams.speculative``). Their tokens are exactly the tokens the non-speculative engine
samples — greedy or not — because a verify row is sampled the way a plain step samples it.

Every step of a speculative sequence:

1. its chunk: prefill tokens, or the next token ``t`` plus the drafts ``d_1..d_m`` (``m ≤ k``, as the
   scheduler's budget allows);
2. V4: a decoding sequence with a slot in the engine's slot decoder (``StaticRunner.takes_verify``;
   on CPU the host slots, on GPU the CUDA-graph step) verifies there: ``1 + k`` tokens per slot
   (the drafts padded) in one fixed-shape step (``StaticDecoder.verify``), the rejected offsets
   undone by ``accept`` (``engine/model/slot_rewind.py``). Every other chunk — every V4.1 chunk:
   V4.1's slot decoder has no verify, so its speculative sequences never take a slot — runs in
   one general-path forward, its state marked before a verify (``engine/model/rewind.py``,
   ``engine/model/v41/rewind.py``). Both give every fed token's verify rows (V4: final streams;
   V4.1: ``forward(logits="taps")``'s head input and DSpark target features);
3. a sequence at its end picks row ``j``'s token ``g_j`` (from ``t`` on) as a plain step would:
   plain greedy rows take the exact argmax (all rows of all such sequences in one head call);
   any other row goes through ``Sampler.sample`` alone, with the request's state advanced by
   ``g_0..g_{j-1}`` — so its ``(seed, step)`` uniform, penalties, ``min_tokens``, logit bias,
   grammar and logprobs are those of the plain step at that position. Row ``j + 1`` is used only
   while ``d_{j+1} == g_j`` (its logits assumed that token); the first disagreement, a stop
   token, EOS or ``max_tokens`` ends the run. So ``g_0..g_a`` are emitted, ``a`` drafts accepted,
   and the state is rewound to ``t, d_1..d_a``. For sampled requests this is rejection sampling
   with a deterministic draft: ``d`` survives with probability ``p(d)``, and a rejected position
   keeps the token drawn from ``p`` itself, so the output distribution is the target's (and, per
   seed, the very tokens of the plain sampler);
4. the drafter is fed the consumed rows (row ``p``, token ``p + 1``) and proposes the next ``k``
   greedy drafts from the last one. A V4 sequence that verified in a slot drafts there too
   (``engine/model/slots/mtp_draft.py``: its MTP window in the same slot of an ``MTPPool``, one
   fixed-shape step per batch, a CUDA graph per bucket on GPU), so its step never leaves the
   slots; its window moves back into ``seq.draft`` (``MTPPool.export``) when the sequence leaves
   its slot for the general path, and into the slot (``load``) when it moves in. The others feed
   and draft on the general path (``mtp.Drafter``, ``DSparkDrafter``).

With a KV store, drafts never reach past the next unit boundary (``unit_tokens``: 128 for the
released shapes), so a sequence always lands exactly on it once and the boundary snapshot is
taken there, after acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from deepserve.protocol import FinishReason, TokenLogprob
from engine.model.lm_head import HeadRows
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.mtp import DraftState
from engine.model.slots.mtp_draft import SlotDrafter
from engine.runtime.config import SpeculativeConfig
from engine.runtime.spec_targets import target_for
from engine.runtime.sequence import Sequence
from engine.runtime.static_runner import StaticRunner
from engine.sampling import Sampler


@dataclass
class SpecResult:
    """One sequence's outcome of a speculative step."""

    consumed: int  # tokens now in the state (add to ``num_computed``)
    tokens: list[int] = field(default_factory=list)  # new output tokens (empty: a prefill chunk)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the request asks
    drafted: int = 0  # drafts verified this step
    accepted: int = 0  # of which accepted


class Feed(NamedTuple):
    """A sequence's rows for its draft window after a step: ``rows[i]`` at ``first_pos + i``,
    followed by ``next_ids[i]``; ``propose``: it is at its end and running, so it wants drafts."""

    seq: Sequence
    rows: torch.Tensor  # (S, ...): the target's verify rows (V4: final streams (S, hc, H); V4.1: taps (S, 1 + taps, H))
    next_ids: list[int]
    first_pos: int
    propose: bool
    verified: int | None = None  # its row in the step's slot verify (it drafts in the slots), else None


class SpecDecoder:
    """Drafts and verifies for the engine core (module docstring)."""

    def __init__(self, model: DeepseekV4ForCausalLM, sampler: Sampler, config: SpeculativeConfig, slot_drafts: bool = True) -> None:
        """``model``: a V4 or V4.1 model (``spec_targets.target_for``: ``CheckpointError`` when
        ``config.method`` is not its family's or it has no draft layers); ``slot_drafts``:
        sequences that verify in a slot draft there too (module docstring); False drafts every
        sequence on the general path (benchmarks compare the two)."""
        self.model, self.sampler, self.config = model, sampler, config
        self.k = config.num_speculative_tokens
        self.target = target_for(model, config)
        self.drafter = self.target.drafter
        self.slot_drafts = slot_drafts
        self.slot_drafter: SlotDrafter | None = None  # made on the first slot verify (it takes the slot decoder's sizes)
        self.unit = model.config.unit_tokens  # a KV store saves at these boundaries
        if self.k + 1 > model.config.sliding_window - 1:
            raise ValueError("num_speculative_tokens + 1 must be below the sliding window")

    @staticmethod
    def takes(seq: Sequence) -> bool:
        """Whether ``seq`` decodes speculatively (fixed per request: module docstring)."""
        req = seq.request
        return req.sampling.speculative and not req.prefill_only and req.sampling.prompt_logprobs is None

    @torch.inference_mode()
    def step(self, batch: list[tuple[Sequence, int]], units: bool = False, static: StaticRunner | None = None) -> list[SpecResult]:
        """Run ``batch`` (each sequence with its scheduled token count) through steps 1-4;
        ``units``: a KV store saves unit boundaries, so no verify reaches past the next one;
        ``static``: the engine's slot decoder, where decoding sequences verify (module docstring;
        not for a family without slot verify: its speculative sequences stay on the general path)."""
        static = static if self.target.slots else None
        fed, slotted = [], []
        for seq, n in batch:
            held = static is not None and static.holds(seq)
            if seq.state is None and not held:  # new, or preempted: a fresh main state and MTP window
                seq.state, seq.draft, seq.draft_ids = self.model.new_state(), None, []
            real = min(n, seq.remaining)
            drafts = seq.draft_ids[: min(n - real, self._room(seq))] if real == seq.remaining else []
            drafts = self._clamp(seq, drafts) if units else drafts
            fed.append((real, drafts))
            slotted.append(static is not None and real == seq.remaining == 1 and static.takes_verify(seq))
        if static is not None and self.slot_drafts:
            self._place_windows([seq for seq, _ in batch], slotted, static)
        rows: list[torch.Tensor | None] = [None] * len(batch)  # head inputs (1 + m, H) of each sequence at its end
        streams: list[torch.Tensor] = [torch.empty(0)] * len(batch)  # verify rows of every fed token
        marks = self._general(batch, fed, slotted, rows, streams)
        at = [i for i, s in enumerate(slotted) if s]
        every = None
        if at:
            assert static is not None
            width = static.decoder.verify_width
            seqs = [batch[i][0] for i in at]
            ids = [[seq.tokens[seq.num_computed], *fed[i][1]] for seq, i in zip(seqs, at)]
            hidden, every = static.verify(seqs, [r + [0] * (width - len(r)) for r in ids])  # (n, width, H), (n, width, hc, H)
            for j, (i, r) in enumerate(zip(at, ids)):
                rows[i], streams[i] = hidden[j, : len(r)], every[j]
        verified = {i: j for j, i in enumerate(at)} if self.slot_drafts and self.slot_drafter is not None else {}  # row in the verify
        greedy = self._greedy_targets(batch, rows)
        results, feeds, kept = [], [], []
        for i, (seq, _) in enumerate(batch):
            (real, drafts), hidden_i = fed[i], rows[i]
            res = self._accept(seq, real, drafts, marks[i], hidden_i, greedy[i])
            first = seq.num_computed
            consumed = streams[i][: res.consumed]  # (consumed, ...): the rows now in the state
            feeds.append(Feed(seq, consumed, seq.tokens[first + 1 : first + res.consumed + 1], first, hidden_i is not None and res.finish_reason is None, verified.get(i)))
            if slotted[i]:
                kept.append(res.consumed)
            results.append(res)
        if at:
            static.accept(kept)  # type: ignore[union-attr]
        self._draft(feeds, every, static)
        return results

    def _place_windows(self, seqs: list[Sequence], slotted: list[bool], static: StaticRunner) -> None:
        """Each MTP window where this step drafts it: out of the slot pool for a sequence that
        left its slot (all of these first: a freed slot may already hold another sequence), then
        into its slot for a sequence that verifies there."""
        if self.slot_drafter is None:
            if not any(slotted):
                return
            dec = static.decoder
            self.slot_drafter = SlotDrafter(self.model, self.drafter.layer, dec.max_slots, self.k, dec.buckets, getattr(dec, "use_graphs", False))
        pool = self.slot_drafter.pool
        for seq, s in zip(seqs, slotted):
            d = seq.draft
            if d is not None and d.slot is not None and not (s and static.slot(seq) == d.slot):
                pool.export(d.slot, d)
        for seq, s in zip(seqs, slotted):
            if not s:
                continue
            if seq.draft is None:  # never fed (no live feed yet): an empty window from here on
                seq.draft = DraftState(self.drafter.layer.new_state(), seq.num_computed)
            if seq.draft.slot is None:
                pool.load(static.slot(seq), seq.draft)

    def _general(
        self, batch: list[tuple[Sequence, int]], fed: list[tuple[int, list[int]]], slotted: list[bool],
        rows: list[torch.Tensor | None], streams: list[torch.Tensor],
    ) -> list[Any]:  # fmt: skip
        """One general-path forward of the sequences not in a slot: fills their ``streams`` and, at
        their end, ``rows``; the rewind marks of those that verify drafts."""
        marks: list[Any] = [None] * len(batch)
        at = [i for i, s in enumerate(slotted) if not s]
        if not at:
            return marks
        chunks = []
        for i in at:
            seq, (real, drafts) = batch[i][0], fed[i]
            marks[i] = self.target.mark(seq.state) if drafts else None
            chunks.append((seq.state, seq.tokens[seq.num_computed : seq.num_computed + real] + drafts))
        every = self.target.forward(chunks)  # (N, ...): the target's verify rows
        heads = self._verify_rows([batch[i] for i in at], [fed[i] for i in at], every)
        start = 0
        for i, h in zip(at, heads):
            width = fed[i][0] + len(fed[i][1])
            rows[i], streams[i] = h, every[start : start + width]
            start += width
        return marks

    @staticmethod
    def _room(seq: Sequence) -> int:
        """Drafts that can still become output: a verify of ``d`` yields up to ``d + 1`` tokens, so
        none past ``max_tokens`` (nor, then, past the context length) is fed."""
        assert seq.sampling is not None
        return max(0, seq.request.sampling.max_tokens - seq.sampling.step - 1)

    def _clamp(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """``drafts`` cut so the verify ends at the next unit boundary at the latest."""
        boundary = (seq.num_computed // self.unit + 1) * self.unit
        return drafts[: max(0, boundary - seq.num_computed - 1)]

    def _verify_rows(self, batch: list[tuple[Sequence, int]], fed: list[tuple[int, list[int]]], streams: torch.Tensor) -> list[torch.Tensor | None]:
        """Each sequence at its end: the head's input ``(1 + m, H)`` at its last real token and at
        each draft; None for a prefill chunk that does not reach the end."""
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
        hidden = self.target.head_input(streams.index_select(0, torch.tensor(rows, device=streams.device)))  # (R, H)
        return [None if s is None else hidden[s[0] : s[1]] for s in spans]

    def _greedy_targets(self, batch: list[tuple[Sequence, int]], rows: list[torch.Tensor | None]) -> list[list[int] | None]:
        """The exact greedy token of every row of the plain greedy sequences, in one head call."""
        plain = [i for i, (seq, _) in enumerate(batch) if rows[i] is not None and seq.sampling is not None and seq.sampling.plain_greedy]
        out: list[list[int] | None] = [None] * len(batch)
        if plain:
            tokens = self.model.head.argmax(torch.cat([rows[i] for i in plain])).tolist()  # type: ignore[misc]
            at = 0
            for i in plain:
                n = rows[i].shape[0]  # type: ignore[union-attr]
                out[i], at = [int(t) for t in tokens[at : at + n]], at + n
        return out

    def _accept(
        self, seq: Sequence, real: int, drafts: list[int], m: Any, hidden: torch.Tensor | None, greedy: list[int] | None
    ) -> SpecResult:
        """Step 3 for one sequence; appends its new tokens to ``seq.tokens``. Row ``j``'s token is
        the one the non-speculative sampler picks there: the exact greedy token (``greedy``), or
        ``Sampler.sample`` on that row alone with the state advanced by the tokens before it (its
        ``(seed, step)`` uniform, penalties, logit rules, grammar and logprobs as in a plain step);
        rows after the first disagreeing draft are never sampled."""
        if hidden is None:
            return SpecResult(consumed=real)
        assert seq.sampling is not None
        res = SpecResult(consumed=real, drafted=len(drafts))
        for j in range(hidden.shape[0]):
            if greedy is not None:
                token, lp = greedy[j], None
                res.finish_reason = self.sampler.advance(seq.sampling, token)
            else:
                out = self.sampler.sample(HeadRows(self.model.head, hidden[j : j + 1]), [seq.sampling])
                token, lp, res.finish_reason = int(out.token_ids[0]), out.logprobs[0], out.finish_reasons[0]
            res.tokens.append(token)
            seq.tokens.append(token)
            if lp is not None:
                res.logprobs.append(lp)
            if res.finish_reason is not None or j == len(drafts) or drafts[j] != token:
                break
            res.accepted += 1
        res.consumed += len(res.tokens) - 1  # the accepted drafts before the last new token
        if m is not None:
            assert seq.state is not None
            self.target.rewind(seq.state, m, res.consumed)
        return res

    def _draft(self, feeds: list[Feed], every: torch.Tensor | None, static: StaticRunner | None) -> None:
        """Step 4: feed the consumed rows to each MTP window; new drafts for the sequences at their
        end: those that verified in a slot through the slot draft step (from the verify's
        streams ``every``), the others on the general path."""
        for f in feeds:
            f.seq.draft_ids = []
        live = [f for f in feeds if len(f.next_ids) == f.rows.shape[0]]  # a finished run lacks its last next token
        slotted = [f for f in live if f.verified is not None and f.propose]  # a finished one is not fed: it leaves its slot
        if slotted:
            assert every is not None and static is not None and self.slot_drafter is not None
            slots = [static.slot(f.seq) for f in slotted]
            assert all(self.slot_drafter.pool.next_pos[s] == f.first_pos for s, f in zip(slots, slotted)), "MTP window out of step"
            rows = [f.verified for f in slotted]
            sel = every if rows == list(range(every.shape[0])) else every[torch.tensor(rows, device=every.device)]
            for f, d in zip(slotted, self.slot_drafter.draft(slots, sel, [f.next_ids for f in slotted])):
                f.seq.draft_ids = d
            live = [f for f in live if f.verified is None]
        if not live:
            return
        for f in live:
            if f.seq.draft is None:
                f.seq.draft = self.drafter.new_state()
        states = [f.seq.draft for f in live]
        last = self.drafter.feed(states, [f.rows for f in live], [f.next_ids for f in live], [f.first_pos for f in live])
        pick = [j for j, f in enumerate(live) if f.propose]
        if not pick:
            return
        drafts = self.drafter.propose([states[j] for j in pick], last[torch.tensor(pick, device=last.device)], self.k)  # type: ignore[misc]
        for j, d in zip(pick, drafts):
            live[j].seq.draft_ids = d
