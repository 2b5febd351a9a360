"""The sampler: one call per engine step turns a batch of last-position logits into tokens.

Per step, for the (B, V) float32 logits of the scheduled sequences, in this order:
1. logprobs source, if any row asks and ``logprobs_mode == "raw"``: log_softmax of the model's
   logits as given (vLLM v1's default, and OpenAI's: independent of temperature, penalties,
   truncation and grammar);
2. ``logit_bias`` / ``min_tokens`` / the reasoning cap, then penalties (``penalties.py``), on the
   rows that set any;
3. grammar masks (``structured.py``) of rows whose grammar is active: a row allowing at most
   ``grammar_sparse_max`` tokens (most grammar positions) is gathered down to those tokens and
   sampled over them alone; wider rows get the bitmask applied in one batched call;
4. greedy rows (temperature < 1e-5): argmax;
5. other rows: divide by temperature, min-p, top-k, top-p (``distribution.py``), then an
   inverse-CDF draw with the row's own uniform for ``(seed, step)`` (``state.py``);
6. logprobs: the sampled token's and the ``top_logprobs`` best, from step 1 (raw) or, with
   ``logprobs_mode == "processed"``, from the distribution actually sampled (after 2, 3 and 5;
   for greedy rows after 2 and 3);
7. each state records its token (output ids, grammar, step) and gets its finish reason
   (``finish.py``).
The logits tensor is consumed: steps 2-3 modify it in place.

``sample`` also takes a ``LogitSource`` instead of a tensor (a tensor on an accelerator is
wrapped in one, ``DeviceLogits``): rows that are plain greedy (no
logprobs, penalties or grammar) then take the source's exact argmax (on CPU the model's int8
screen + exact recheck, ``engine/model/lm_head.py``) and only the other rows' logits are made.

Fast paths: a batch of greedy rows with nothing else is one argmax; plain temperature rows skip
truncation entirely; random rows are transformed inside the logits tensor rather than copied out
when they are most of the batch. The draw is vectorised across rows; truncation loops over row
views (no (B, V) temporaries). CPU ``exp`` is kept off its slow paths (-inf and denormal results,
see ``distribution.exp_shifted_``), which otherwise cost 4-50x on masked or low-temperature rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from deepserve.protocol import FinishReason, SamplingParams, TokenLogprob
from engine.sampling.distribution import (
    NEG_INF,
    apply_min_p,
    draw,
    log_softmax,
    mask_below,
    top_k_top_p_thresholds,
)
from engine.sampling.errors import InvalidConstraintError
from engine.sampling.finish import check_finish
from engine.sampling.penalties import apply_logit_rules, apply_penalties
from engine.sampling.state import SamplingState
from engine.sampling.structured import (
    GrammarCompilerCache,
    allocate_bitmask,
    allowed_counts,
    allowed_ids,
    apply_bitmask,
)

LogprobsMode = Literal["raw", "processed"]


class LogitSource(Protocol):
    """Logit rows computed on demand (the engine's last hidden states and the model's head)."""

    def logits(self, rows: list[int]) -> torch.Tensor:
        """fp32 logits ``(len(rows), V)`` of the given rows."""
        ...

    def argmax(self, rows: list[int]) -> torch.Tensor:
        """``logits(rows).argmax(-1)`` exactly, ``(len(rows),)`` int64, however computed."""
        ...


class DeviceLogits:
    """A ``LogitSource`` over logits on an accelerator: plain greedy rows take their argmax
    there (only token ids cross to the host); other rows are copied to the host as float32."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.full = logits  # (B, V)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        if len(rows) == self.full.shape[0]:
            return self.full
        return self.full.index_select(0, torch.as_tensor(rows, device=self.full.device))

    def logits(self, rows: list[int]) -> torch.Tensor:
        return self._rows(rows).to("cpu", torch.float32)

    def argmax(self, rows: list[int]) -> torch.Tensor:
        return self._rows(rows).argmax(-1).cpu()  # first maximal index, as on the host


@dataclass(frozen=True)
class SamplerConfig:
    """Settings of one engine's sampler.

    ``vocab_size``: the model's (lm_head) vocabulary, the width of the logits.
    ``eos_token_ids``: the model's end-of-sequence ids (the checkpoint's ``eos_token_id``).
    ``logprobs_mode``: "raw" = log_softmax of the model's logits; "processed" = of the distribution
    sampled from. ``seed``: seeds the seeds drawn for requests that bring none (so a whole engine
    run is reproducible in tests). ``top_p_candidates``: how many largest logits top-p searches
    first (then 16x as many, then the sorted row). ``grammar_sparse_max``: a grammar row allowing at most this many
    tokens is sampled over those tokens only, skipping the vocabulary-wide passes.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    logprobs_mode: LogprobsMode = "raw"
    seed: int | None = None
    top_p_candidates: int = 256
    grammar_sparse_max: int = 4096

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")
        if not self.eos_token_ids or not all(0 <= e < self.vocab_size for e in self.eos_token_ids):
            raise ValueError("eos_token_ids must be non-empty ids inside the vocabulary")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError("logprobs_mode must be 'raw' or 'processed'")


@dataclass
class SampleOutput:
    """One step's result; entry i belongs to ``states[i]``."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: list[TokenLogprob | None]  # None where the request did not ask
    finish_reasons: list[FinishReason | None]  # None = still running


class Sampler:
    """Samples one token per request per step; stateless apart from reusable buffers."""

    def __init__(self, config: SamplerConfig, grammars: GrammarCompilerCache | None = None) -> None:
        if grammars is not None and grammars.vocab_size != config.vocab_size:
            raise ValueError(f"grammar vocab {grammars.vocab_size} != model vocab {config.vocab_size}")
        self.config = config
        self.grammars = grammars
        self.eos = frozenset(config.eos_token_ids)
        self._seeds = random.Random(config.seed)
        self._bitmask = allocate_bitmask(1, config.vocab_size)  # grown on demand, (B, ceil(V/32))

    # -- per request --------------------------------------------------------------------------

    def new_state(
        self, params: SamplingParams, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()
    ) -> SamplingState:
        """The state of a new request, or of one resumed after ``output_token_ids`` (migration,
        prefill handoff): penalties, grammar and the seeded stream continue where they were.

        Compiles the request's grammar (cached); raises ``InvalidConstraintError`` for a bad one.
        """
        grammar = None
        if params.constraint is not None:
            if self.grammars is None:
                raise InvalidConstraintError("structured output is not enabled on this engine")
            grammar = self.grammars.new_state(params.constraint)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        prompt_ids = SamplingState.distinct_ids(prompt_token_ids) if params.repetition_penalty != 1.0 else None
        state = SamplingState(params=params, seed=seed, grammar=grammar, prompt_ids=prompt_ids)
        for t in output_token_ids:
            if not state.record(int(t)):
                raise ValueError(f"output token {t} violates the request's grammar")
        return state

    # -- per step -----------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor | LogitSource, states: Sequence[SamplingState]) -> SampleOutput:
        """Sample one token for each row of ``logits`` (B, V), row i for ``states[i]``.

        ``logits`` is a tensor, or a ``LogitSource`` that computes rows on demand: then the rows
        that only need the greedy token (no logprobs, penalties or grammar) get it from the
        source's exact ``argmax`` and only the other rows' logits are computed.
        Float32 CPU logits are modified in place (others are copied to that first). Advances
        every state by one token and sets its ``finish_reason`` when it ends; finished states must
        not be passed again.
        """
        assert not any(s.finished for s in states), "a finished request was scheduled for sampling"
        if isinstance(logits, torch.Tensor) and logits.device.type != "cpu":
            logits = DeviceLogits(logits)  # greedy rows: argmax where the logits are, ids copied back
        if isinstance(logits, torch.Tensor):
            tokens, logprobs = self._choose(logits, states)
        else:
            tokens, logprobs = self._choose_from(logits, states)
        return SampleOutput(tokens, logprobs, self._record(tokens, states))

    def _choose_from(self, source: LogitSource, states: Sequence[SamplingState]) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
        """Plain greedy rows through ``source.argmax``; the others through ``_choose``."""
        plain = [i for i, s in enumerate(states) if s.plain_greedy]
        if not plain:
            return self._choose(source.logits(list(range(len(states)))), states)
        tokens = torch.empty(len(states), dtype=torch.int64)
        tokens[plain] = source.argmax(plain)
        logprobs: list[TokenLogprob | None] = [None] * len(states)
        rest = [i for i, s in enumerate(states) if not s.plain_greedy]
        if rest:
            rest_tokens, rest_logprobs = self._choose(source.logits(rest), [states[i] for i in rest])
            tokens[rest] = rest_tokens
            for i, lp in zip(rest, rest_logprobs):
                logprobs[i] = lp
        return tokens, logprobs

    def _choose(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
        """Tokens and logprobs for the rows of ``logits`` (steps 1-6 of the module docstring)."""
        B, V = logits.shape
        assert B == len(states), f"{B} logit rows for {len(states)} states"
        assert V == self.config.vocab_size, f"logits width {V} != vocab_size {self.config.vocab_size}"
        if logits.dtype != torch.float32 or logits.device.type != "cpu":
            logits = logits.to("cpu", torch.float32)  # the sampler runs on CPU (one (B, V) copy)
        raw_mode = self.config.logprobs_mode == "raw"

        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs]
        lp_src: torch.Tensor | None = None  # (L, V) log-probabilities of the lp_rows
        if lp_rows and raw_mode:
            lp_src = log_softmax(_rows(logits, lp_rows))

        rule_rows = [i for i, s in enumerate(states) if s.has_logit_rules]
        if rule_rows:
            apply_logit_rules(logits, rule_rows, [states[i] for i in rule_rows], self.config.eos_token_ids)
        pen_rows = [i for i, s in enumerate(states) if s.has_penalties]
        if pen_rows:
            apply_penalties(logits, pen_rows, [states[i] for i in pen_rows])
        sparse_rows, sparse_ids = self._apply_grammars(logits, states)

        # Two groups, each sampled as one matrix: dense rows over the whole vocabulary, and
        # grammar rows with few allowed tokens over just those (columns -> ids via sparse_ids).
        tokens = torch.empty(B, dtype=torch.int64)
        processed: dict[int, torch.Tensor] = {}  # row -> (C,) final logits, for processed logprobs
        want = set(lp_rows) if lp_rows and not raw_mode else set()
        in_sparse = set(sparse_rows)
        dense_rows = [i for i in range(B) if i not in in_sparse]
        if dense_rows:
            x = logits if len(dense_rows) == B else _rows(logits, dense_rows)  # (D, V)
            tokens[dense_rows] = self._pick(x, dense_rows, states, want, processed)
        if sparse_rows:
            valid = sparse_ids >= 0  # (S, C)
            row_idx = torch.as_tensor(sparse_rows, dtype=torch.int64).unsqueeze(1)  # (S, 1)
            x = logits[row_idx, sparse_ids.clamp(min=0)].masked_fill_(~valid, NEG_INF)  # (S, C)
            pos = self._pick(x, sparse_rows, states, want, processed)  # (S,)
            tokens[sparse_rows] = sparse_ids.gather(1, pos.unsqueeze(1)).squeeze(1)
            for j, i in enumerate(sparse_rows):  # back to full-vocabulary rows
                if i in processed:
                    processed[i] = torch.full((V,), NEG_INF).index_copy_(
                        0, sparse_ids[j][valid[j]], processed[i][valid[j]]
                    )

        if want:
            lp_src = log_softmax(torch.stack([processed[i] for i in lp_rows]))
        logprobs = self._gather_logprobs(lp_src, lp_rows, tokens, states) if lp_rows else [None] * B

        return tokens, logprobs

    def _record(self, tokens: torch.Tensor, states: Sequence[SamplingState]) -> list[FinishReason | None]:
        """Step 7: each state records its token and gets its finish reason."""
        return [self.advance(s, t) for s, t in zip(states, tokens.tolist())]

    def advance(self, state: SamplingState, token_id: int) -> FinishReason | None:
        """Record one chosen token in ``state`` (output ids, grammar, step) and set its finish
        reason: step 7 for one row, also what speculative decoding calls per accepted token."""
        accepted = state.record(token_id)
        state.finish_reason = check_finish(
            state.params,
            token_id,
            state.step,
            self.eos,
            grammar_terminated=state.grammar is not None and state.grammar.is_terminated(),
            grammar_rejected=not accepted,
        )
        return state.finish_reason

    def _pick(
        self,
        x: torch.Tensor,
        rows: list[int],
        states: Sequence[SamplingState],
        want: set[int],
        processed: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """Column picked for each row of ``x`` (R, C) (``rows[j]`` is its batch row), (R,) int64.

        ``x`` is consumed (modified in place). Rows in ``want`` leave their final logits in
        ``processed``.
        """
        R = len(rows)
        out = torch.empty(R, dtype=torch.int64)
        greedy = [j for j, i in enumerate(rows) if states[i].greedy]
        rand = [j for j, i in enumerate(rows) if not states[i].greedy]
        if greedy:
            if len(greedy) == R:
                out = x.argmax(-1)
            else:  # row views: no copy of the greedy rows
                out[greedy] = torch.stack([x[j].argmax() for j in greedy])
            for j in greedy:
                if rows[j] in want:
                    processed[rows[j]] = x[j].clone()
        if rand:
            # Transform the random rows in place inside x when they are most of it (greedy rows
            # ride along untouched and their draws are discarded); copy them out when few.
            if len(rand) == R or 2 * len(greedy) <= len(rand):
                r, picks = x, rand  # picks: the rows of r that hold the random requests
            else:
                r, picks = _rows(x, rand), list(range(len(rand)))  # (R', C)
            settings: list[SamplingParams | None] = [None] * r.shape[0]
            u = [0.5] * r.shape[0]
            for j, jr in zip(rand, picks):
                settings[jr] = states[rows[j]].params
                u[jr] = states[rows[j]].uniform()
            self._truncate(r, settings)
            out[rand] = draw(r, torch.tensor(u, dtype=torch.float64))[picks]
            for j, jr in zip(rand, picks):
                if rows[j] in want:
                    processed[rows[j]] = r[jr]
        return out

    def _apply_grammars(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> tuple[list[int], torch.Tensor]:
        """Fill the masks of rows with an active grammar. Rows allowing at most
        ``grammar_sparse_max`` tokens are returned, with their allowed ids (S, C) padded with -1,
        to be sampled over those columns only; the other rows are masked in ``logits`` in place.
        A row allowing nothing (cannot happen with a sound grammar) gets EOS only.
        """
        B = len(states)
        if self._bitmask.shape[0] < B:
            self._bitmask = allocate_bitmask(B, self.config.vocab_size)
        rows = [i for i, s in enumerate(states) if s.grammar is not None and s.grammar.fill_mask(self._bitmask, i)]
        if not rows:
            return [], _NO_IDS
        counts = allowed_counts(self._bitmask[rows]).tolist()  # (G,)
        limit = self.config.grammar_sparse_max
        dense = [i for i, n in zip(rows, counts) if n > limit]
        if dense:
            apply_bitmask(logits, self._bitmask, dense)
        sparse = [i for i, n in zip(rows, counts) if n <= limit]
        if not sparse:
            return [], _NO_IDS
        ids = allowed_ids(self._bitmask[sparse], self.config.vocab_size, max([1] + [n for n in counts if n <= limit]))
        ids[ids[:, 0] < 0, 0] = self.config.eos_token_ids[0]  # rows allowing nothing
        return sparse, ids

    def _truncate(self, x: torch.Tensor, settings: list[SamplingParams | None]) -> None:
        """Temperature, min-p, top-k, top-p in place on the rows of ``x`` (R, C) whose settings
        are given; rows with ``None`` are left as they are."""
        temps = [1.0 if p is None else p.temperature for p in settings]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, dtype=torch.float32).unsqueeze(1))
        min_p = [j for j, p in enumerate(settings) if p is not None and p.min_p > 0.0]
        if min_p:
            apply_min_p(x, min_p, [settings[j].min_p for j in min_p])
        trunc = [j for j, p in enumerate(settings) if p is not None and (p.top_k > 0 or p.top_p < 1.0)]
        if trunc:
            top_k = torch.tensor([settings[j].top_k for j in trunc], dtype=torch.int64)
            top_p = torch.tensor([settings[j].top_p for j in trunc], dtype=torch.float32)
            mask_below(x, trunc, top_k_top_p_thresholds(x, trunc, top_k, top_p, self.config.top_p_candidates))

    @staticmethod
    def _gather_logprobs(
        lp: torch.Tensor, lp_rows: list[int], tokens: torch.Tensor, states: Sequence[SamplingState]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(states)
        chosen = lp.gather(1, tokens[lp_rows].unsqueeze(1)).squeeze(1).tolist()  # (L,)
        n_top = max(states[i].params.top_logprobs for i in lp_rows)
        top_v, top_i = lp.topk(n_top, dim=-1) if n_top else (lp[:, :0], lp[:, :0].long())  # (L, n_top)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(lp_rows):
            n = states[i].params.top_logprobs
            top = [(t, v) for t, v in zip(top_i[j][:n], top_v[j][:n]) if v != NEG_INF]
            out[i] = TokenLogprob(logprob=chosen[j], top=top)
        return out


_NO_IDS = torch.empty(0, 0, dtype=torch.int64)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of ``x[rows]``."""
    return x.index_select(0, torch.as_tensor(rows, dtype=torch.int64))
