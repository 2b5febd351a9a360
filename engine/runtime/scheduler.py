"""Continuous-batching scheduler.

Scheduling model. There is no prefill or decode phase, only each sequence's ``num_computed``
versus ``len(tokens)``. Every step has a token budget (``max_num_batched_tokens``) and a
sequence limit (``max_num_seqs``):

1. Running sequences go first, in (priority, arrival) order. Each gets
   ``min(remaining, budget)`` tokens: 1 when decoding (``1 + k`` with ``k`` speculative drafts to
   verify), a chunk when its prefill is unfinished (chunked prefill, mixed in the same batch as
   decodes).
2. If state memory cannot grow for a running sequence, the lowest-ranked running sequence not yet
   scheduled this step is preempted (state dropped, back to the waiting queue front); if there is
   none, the sequence itself waits this step. A preempted sequence is not admitted again in the
   step that preempted it: with a KV store its lookup runs first, so it resumes from the last unit
   it stored (the prompt's last unit, a decode boundary) and recomputes only the tokens after it;
   without one it is recomputed from its tokens.
3. Waiting sequences are admitted in (priority, arrival) order while budget, the sequence limit
   and state memory allow, skipping those whose KV-store load is still running (loads overlap
   the steps) or whose grammar is still compiling (on the grammar pool). Admission never preempts.
4. A chunk never runs past ``snapshot_at`` (the prompt's last whole KV unit), so the state at
   that boundary exists once and can be stored exactly.
5. Fair prefill: while other sequences are running or waiting, a prefill chunk is at most
   ``long_prefill_token_threshold`` tokens (default half the budget), so a long prompt never takes a
   whole step from the decodes behind it or from a short prompt just arrived.

The scheduler only decides; the engine core runs the batch and samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.config import EngineConfig
from engine.runtime.sequence import Sequence, Status
from engine.runtime.state_pool import StatePool


@dataclass
class SchedulerOutput:
    """One step's batch: ``(sequence, number of tokens to feed)``, and who was preempted."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Owns the waiting and running sets and the state pool's accounting."""

    def __init__(self, config: EngineConfig, pool: StatePool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its state slots."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_ids, seq.has_boundary)
        seq.has_boundary = False
        seq.state = None
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.config.prefill_chunk_cap if len(self.running) + len(self.waiting) > 1 else budget
        self.running.sort(key=lambda s: s.sort_key)
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget, cap)
            while not self._grow(seq, n):
                victim = self._victim(exclude=scheduled | {id(seq)})
                if victim is None:
                    n = 0
                    break
                self._preempt(victim)
                out.preempted.append(victim)
            if n:
                out.scheduled.append((seq, n))
                scheduled.add(id(seq))
                budget -= n
        self.waiting.sort(key=lambda s: s.sort_key)
        preempted = {id(s) for s in out.preempted}
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.kv_load is not None or seq.grammar is not None or id(seq) in preempted:
                continue  # its prefix is still loading from the KV store (or, just preempted, not looked up yet), or its grammar compiling
            n = self._chunk(seq, budget, cap)
            if not self._grow(seq, n):
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    @staticmethod
    def _chunk(seq: Sequence, budget: int, cap: int) -> int:
        """Tokens to feed this step: all that remain (a decoding sequence: its next token and its
        drafts), within budget, a prefill chunk within ``cap``, stopping at a snapshot point."""
        if seq.remaining > 1:
            budget = min(budget, cap)
        n = min(seq.remaining + (len(seq.draft_ids) if seq.remaining == 1 else 0), budget)
        if seq.snapshot_at is not None and seq.num_computed < seq.snapshot_at:
            n = min(n, seq.snapshot_at - seq.num_computed)
        return n

    def _grow(self, seq: Sequence, n: int) -> bool:
        ok = self.pool.allocate(seq, seq.block_ids, seq.has_boundary, seq.num_computed + n)
        if ok:
            seq.has_boundary = True
        return ok

    def _victim(self, exclude: set[int]) -> Sequence | None:
        candidates = [s for s in self.running if id(s) not in exclude]
        return max(candidates, key=lambda s: s.sort_key) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        """Drop the state, keep the tokens, wait at the front (and look the prefix up again)."""
        self.running.remove(seq)
        self.pool.free(seq.block_ids, seq.has_boundary)
        seq.has_boundary = False
        seq.state = None
        seq.draft_ids, seq.draft = [], None
        seq.num_computed = 0
        seq.num_cached = 0
        seq.kv_checked = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.insert(0, seq)

    def check_integrity(self) -> None:
        live = {s: (s.block_ids, s.has_boundary) for s in self.running + self.waiting}
        assert all(not s.block_ids and not s.has_boundary for s in self.waiting), "waiting sequence holds state"
        self.pool.check_integrity(live)
