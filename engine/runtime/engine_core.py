"""One engine: ``add_request`` / ``abort_request`` / ``step`` (DeepInfer's outer surface).

``step()`` is three calls: schedule → run the model on the batch → make output (sample the
sequences whose chunk reached their last token, finish them, emit token events).

A request with an output constraint whose grammar is not compiled yet waits in the scheduler's
queue, unschedulable, while the sampler's grammar pool compiles it; each step admits those whose
grammar is ready and fails (``finish_reason="error"``, before any token) those whose grammar
failed to compile or missed ``EngineConfig.grammar_timeout_s``. Other sequences keep stepping.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from engine.errors import CapacityError, ContextLengthExceeded, EngineError, InvalidRequestError
from engine.model.lm_head import HeadRows
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.state import SequenceState
from deepserve.protocol import ErrorCode, FinishReason, GenerateRequest, TokenEvent
from engine.runtime.config import EngineConfig
from engine.runtime.metrics import EngineMetrics
from engine.runtime.prompt_logprobs import record as record_prompt_logprobs
from engine.runtime.scheduler import Scheduler, SchedulerOutput
from engine.runtime.sequence import Sequence
from engine.runtime.speculative import SpecDecoder, SpecResult
from engine.runtime.state_pool import StatePool
from engine.runtime.static_runner import StaticRunner
from engine.sampling.compile_pool import CompileFuture
from engine.sampling import Sampler

if TYPE_CHECKING:
    from engine.parallel.group import ExpertGroup

log = logging.getLogger(__name__)


class KVConnector(Protocol):
    """Moves prompt state between an engine and the KV store (engine/kv_connector.py)."""

    def restore(self, seq: Sequence, model: DeepseekV4ForCausalLM) -> None:
        """Load the longest cached prefix of ``seq.tokens`` into ``seq.state`` (sets num_computed)."""

    def snapshot_stop(self, seq: Sequence) -> int | None:
        """Token count at which the first prefill chunk must stop (the prompt's last whole unit)."""

    def save_due(self, seq: Sequence) -> bool:
        """Whether ``save`` would store something for ``seq`` now."""

    def save(self, seq: Sequence, model: DeepseekV4ForCausalLM) -> None:
        """Store ``seq``'s whole units and a boundary snapshot if ``num_computed`` ends a unit."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed the load-versus-recompute cost model with a measured step."""


class EngineCore:
    """Continuous batching over one model replica (one DP rank)."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        sampler: Sampler,
        config: EngineConfig,
        kv: KVConnector | None = None,
        metrics: EngineMetrics | None = None,
        dp_rank: int = 0,
        ep: ExpertGroup | None = None,
    ) -> None:
        """``ep``: this rank's expert-parallel group (``engine.parallel.group``): the model's routed
        experts are cut to this rank's share and every step runs the group's phases."""
        self.model = model
        self.ep = ep
        self.sampler = sampler
        self.config = config
        self.kv = kv
        self.metrics = metrics
        self.dp_rank = dp_rank
        self.pool = StatePool(model.config, model.dtype, config.state_memory_bytes, config.max_num_seqs)
        self.scheduler = Scheduler(config, self.pool)
        self.seqs: dict[str, Sequence] = {}
        self._pending: list[TokenEvent] = []
        self._kv_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        self._kv_loading: set[Future] = set()
        self.spec: SpecDecoder | None = None
        if ep is not None:
            if config.speculative is not None:
                raise EngineError("speculative decoding is not supported with expert parallelism (--ep)")
            ep.attach(model)
        if config.speculative is not None:  # CheckpointError: the method is not the family's, or no draft layers
            self.spec = SpecDecoder(model, sampler, config.speculative)
        self.static: StaticRunner | None = None
        if config.static_decode is not False:  # None (default): on, CUDA graphs on GPU, host slots on CPU
            try:
                max_tokens = min(config.static_max_tokens, config.max_model_len)
                decoder = None if ep is None else ep.decoder(model, config.max_num_seqs, max_tokens)
                width = 1 if self.spec is None else 1 + self.spec.k  # speculative sequences verify in the slots
                self.static = StaticRunner(model, config.max_num_seqs, max_tokens, decoder=decoder, verify_width=width)
            except (RuntimeError, ValueError) as e:  # e.g. no memory left for the slot pools
                if config.static_decode:
                    raise
                log.warning("static decode off (%s); decoding on the general path", e)

    def set_state_budget(self, budget_bytes: int) -> None:
        """Size the state pool to ``budget_bytes`` (a measured GPU budget, ``engine.runtime.memory``);
        before the first request only."""
        assert not self.seqs, "the state budget is set before requests arrive"
        self.config = replace(self.config, state_memory_bytes=budget_bytes)
        self.pool = StatePool(self.model.config, self.model.dtype, budget_bytes, self.config.max_num_seqs)
        self.scheduler.pool = self.pool

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request; raises ``InvalidRequestError`` (``ContextLengthExceeded``) for one the
        engine cannot serve, ``CapacityError`` when the queue is full."""
        vocab = self.model.config.vocab_size
        if not req.prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        if req.request_id in self.seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        if any(not 0 <= t < vocab for t in req.prompt_token_ids) or any(not 0 <= t < vocab for t in req.output_token_ids):
            raise InvalidRequestError(f"token id outside the vocabulary [0, {vocab})")
        total = len(req.prompt_token_ids) + max(req.sampling.max_tokens, len(req.output_token_ids))
        if total > self.config.max_model_len:
            raise ContextLengthExceeded(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) "
                f"exceeds the context length {self.config.max_model_len}"
            )
        if not self.pool.fits(total):  # it could never be scheduled: refuse now, not wait forever
            raise ContextLengthExceeded(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) needs "
                f"{self.pool.bytes_for(total)} bytes of sequence state; this engine's state memory holds "
                f"{self.pool.capacity_bytes} bytes, at most {self.pool.max_tokens} tokens per sequence"
            )
        if len(self.seqs) >= self.config.max_queue:
            raise CapacityError("engine queue is full")
        tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
        compiling = self._grammar_future(req)
        if compiling is not None:  # admitted by _poll_grammars once compiled
            seq = Sequence(req, None, tokens, len(req.prompt_token_ids), grammar=compiling)
            seq.grammar_deadline = seq.arrival + self.config.grammar_timeout_s
        else:
            seq = Sequence(req, self.sampler.new_state(req.sampling, req.prompt_token_ids, req.output_token_ids), tokens, len(req.prompt_token_ids))
            if self._done_at_start(seq):
                return
        if req.sampling.prompt_logprobs is not None and not req.output_token_ids:
            seq.prompt_logprobs = [None] * seq.num_prompt
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)
        if self.metrics:
            self.metrics.on_arrival(len(req.prompt_token_ids))

    def _grammar_future(self, req: GenerateRequest) -> Future | None:
        """The compile of the request's grammar if it is still running, else None."""
        constraint = req.sampling.constraint
        if constraint is None or self.sampler.grammars is None:
            return None
        fut = self.sampler.grammars.submit(constraint)
        return None if fut.done() else fut

    def _done_at_start(self, seq: Sequence) -> bool:
        """Finish a request that has nothing left to generate (emits its event)."""
        assert seq.sampling is not None
        if seq.sampling.finished or len(seq.request.output_token_ids) >= seq.request.sampling.max_tokens:
            self._finish(seq, "length", emit=True)
            return True
        return False

    def _poll_grammars(self) -> list[Future]:
        """Admit the waiting sequences whose grammar compiled, fail those whose compile failed or
        timed out; the compiles still running."""
        running: list[Future] = []
        now = time.monotonic()
        for seq in list(self.scheduler.waiting):
            fut = seq.grammar
            if fut is None:
                continue
            req = seq.request
            if fut.done():
                seq.grammar = None
                try:
                    seq.sampling = self.sampler.new_state(req.sampling, req.prompt_token_ids, req.output_token_ids)
                except (InvalidRequestError, ValueError) as exc:
                    self._fail(seq, str(exc), exc.code if isinstance(exc, InvalidRequestError) else ErrorCode.INVALID_REQUEST)
                    continue
                if self._done_at_start(seq):
                    continue
            elif now > seq.grammar_deadline + (fut.wait_excused(now) if isinstance(fut, CompileFuture) else 0.0):
                seq.grammar = None
                self._fail(seq, f"the output constraint did not compile within {self.config.grammar_timeout_s:g}s", ErrorCode.INVALID_REQUEST)
            else:
                running.append(fut)
        return running

    def _fail(self, seq: Sequence, message: str, code: ErrorCode) -> None:
        """End a request that never started with an error event (an invalid request)."""
        self._finish(seq, "error", emit=False)
        self._pending.append(
            TokenEvent(seq.request_id, finish_reason="error", error=message, num_prompt_tokens=seq.num_prompt, error_code=code)
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; frees its state. False if unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        if self.static is not None:
            self.static.release(seq, keep_state=False)
        self._pending.append(TokenEvent(request_id, finish_reason="abort", num_prompt_tokens=seq.num_prompt))
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- the step ---------------------------------------------------------------------
    @torch.inference_mode()  # the sampler consumes the model's (inference-mode) logits in place
    def step(self) -> list[TokenEvent]:
        events, self._pending = self._pending, []
        if self.kv is not None:
            self._poll_kv_loads()
        compiling = self._poll_grammars()
        out = self.scheduler.schedule()
        if self.static is not None:
            for seq in out.preempted:  # recompute preemption: the slot's state goes too
                self.static.release(seq, keep_state=False)
        if not out.scheduled:
            if self.ep is not None:
                self._run(out)  # the group steps: this rank joins its phases with 0 rows
            if (self.kv is not None and self._kv_loading) or compiling:
                wait(self._kv_loading | set(compiling), timeout=0.002, return_when=FIRST_COMPLETED)  # no busy spin
            return events
        self._note_scheduled(out)
        kind, t0 = _batch_kind(out), time.perf_counter()
        plain, spec = self._split(out)
        if spec:
            events.extend(self._spec_output(spec, self.spec.step(spec, units=self.kv is not None, static=self.static)))  # type: ignore[union-attr]
        if plain.scheduled:
            events.extend(self._make_output(plain, self._run(plain)))
        if self.kv is not None and out.num_tokens > 2 * len(out.scheduled):
            self.kv.observe_prefill(out.num_tokens, time.perf_counter() - t0)
        if self.metrics:
            self.metrics.on_step(self, out.num_tokens, time.perf_counter() - t0, kind)
        return events

    def _poll_kv_loads(self) -> None:
        """Start a KV-store lookup for each new waiting sequence on the loader thread, and admit
        the sequences whose load finished. Loads (SSD, Redis, shared FS) overlap model steps: a
        sequence stays out of scheduling only while its own load runs."""
        for seq in self.scheduler.waiting:
            if seq.kv_checked or seq.kv_load is not None:
                continue
            if seq.prompt_logprobs is not None:  # every prompt position must run to be scored: no hit
                seq.kv_checked = True
                seq.snapshot_at = self.kv.snapshot_stop(seq)
                continue
            seq.kv_load = self._kv_pool.submit(self.kv.restore, seq, self.model)
            self._kv_loading.add(seq.kv_load)
        for seq in self.scheduler.waiting:
            load = seq.kv_load
            if load is None or not load.done():
                continue
            self._kv_loading.discard(load)
            seq.kv_load = None
            if load.exception() is not None:  # a failed load is a miss, never a wrong state
                log.warning("kv load for %s failed: %s", seq.request_id, load.exception())
                seq.state, seq.num_computed, seq.num_cached = None, 0, 0
            seq.kv_checked = True
            seq.snapshot_at = self.kv.snapshot_stop(seq)

    def _note_scheduled(self, out: SchedulerOutput) -> None:
        now = time.monotonic()
        for seq, _ in out.scheduled:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                if self.metrics:
                    self.metrics.on_scheduled(now - seq.arrival)

    def _split(self, out: SchedulerOutput) -> tuple[SchedulerOutput, list[tuple[Sequence, int]]]:
        """The step's batch without and with the speculative sequences (``SpecDecoder.takes``)."""
        if self.spec is None:
            return out, []
        spec = [(seq, n) for seq, n in out.scheduled if self.spec.takes(seq)]
        if not spec:
            return out, []
        return SchedulerOutput([(seq, n) for seq, n in out.scheduled if not self.spec.takes(seq)], out.preempted), spec

    def _run(self, out: SchedulerOutput) -> HeadRows | torch.Tensor:
        """Run the step's batch; the result covers the scheduled sequences in order: last hidden
        states as a ``HeadRows`` source, or float32 logits ``(B, V)`` when some rows decoded
        through the static runner."""
        general: list[int] = []
        static: list[int] = []
        chunks = []
        for i, (seq, n) in enumerate(out.scheduled):
            if self.static is not None and self.static.takes(seq, n):
                static.append(i)
                continue
            if seq.state is None:
                seq.state = self.model.new_state()
            general.append(i)
            chunks.append((seq.state, seq.tokens[seq.num_computed : seq.num_computed + n]))
        seqs = [out.scheduled[i][0] for i in general]
        run_static, run_general = bool(static), bool(general)
        if self.ep is not None:  # every rank runs each phase some rank has rows for (engine.parallel.group)
            run_static, run_general = self.ep.any(run_static, run_general)
        slotted = None
        if run_static:  # phase 1 (under EP possibly 0 slots here)
            assert self.static is not None
            slotted = self.static.step([out.scheduled[i][0] for i in static])  # logits or hidden states
        hidden = not static or self.static.output == "hidden"  # type: ignore[union-attr]
        if general:  # phase 2
            rest = self._forward(seqs, chunks, "hidden" if hidden else "last")  # (B, H) or (B, V)
        elif run_general:
            self.ep.join_general(self.model)  # type: ignore[union-attr]
        if not static:
            return HeadRows(self.model.head, rest) if general else torch.empty(0)
        assert slotted is not None
        if general:
            rows = slotted.new_empty(len(out.scheduled), slotted.shape[1])
            rows[static] = slotted
            rows[general] = rest
            slotted = rows
        return HeadRows(self.model.head, slotted) if hidden else slotted

    def _forward(self, seqs: list[Sequence], chunks: list[tuple[SequenceState, list[int]]], logits: Literal["hidden", "last"]) -> torch.Tensor:
        """The general path's model call: each chunk's last hidden state ``(B, H)`` or logits
        ``(B, V)``; chunks that score prompt tokens get every row's hidden state, scored here."""
        scoring = [k for k, seq in enumerate(seqs) if seq.prompt_logprobs is not None and seq.num_computed + 1 < seq.num_prompt]
        if not scoring:
            return self.model(chunks, logits=logits)
        every = self.model(chunks, logits="hidden_all")  # (N, H)
        ends = torch.tensor([len(ids) for _, ids in chunks]).cumsum(0)  # (B,)
        for k in scoring:
            seq, a = seqs[k], int(ends[k]) - len(chunks[k][1])
            assert seq.prompt_logprobs is not None
            top = seq.request.sampling.prompt_logprobs or 0
            record_prompt_logprobs(seq.prompt_logprobs, seq.tokens, seq.num_computed, every[a : int(ends[k])], self.model.head, top)
        last = every[(ends - 1).to(every.device)]  # (B, H)
        return last if logits == "hidden" else self.model.head.logits(last)

    def _make_output(self, out: SchedulerOutput, result: HeadRows | torch.Tensor) -> list[TokenEvent]:
        rows, ready = [], []
        for i, (seq, n) in enumerate(out.scheduled):
            seq.num_computed += n
            if self.kv is not None:
                self._save(seq)  # stores units only on whole-unit boundaries
            if seq.remaining == 0:
                rows.append(i)
                ready.append(seq)
        if not ready:
            return []
        if len(rows) < len(out.scheduled):  # the sequences sampled this step
            result = result[rows] if isinstance(result, torch.Tensor) else result.subset(rows)
        sample = self.sampler.sample(result, [s.sampling for s in ready])
        now = time.monotonic()
        events = []
        for j, seq in enumerate(ready):
            token = int(sample.token_ids[j])
            seq.tokens.append(token)
            reason = sample.finish_reasons[j]
            if seq.request.prefill_only and reason is None:
                reason = "length"  # hand off to a decode worker
            events.append(self._event(seq, [token], None if sample.logprobs[j] is None else [sample.logprobs[j]], reason, now))
        return events

    def _spec_output(self, batch: list[tuple[Sequence, int]], results: list[SpecResult]) -> list[TokenEvent]:
        """Events of a speculative step (``SpecDecoder.step`` appended the tokens already)."""
        now = time.monotonic()
        events = []
        for (seq, _), res in zip(batch, results):
            seq.num_computed += res.consumed
            if self.metrics and res.drafted:
                self.metrics.on_spec(res.drafted, res.accepted)
            if self.kv is not None:
                self._save(seq)  # after acceptance: the state holds accepted tokens only
            if res.tokens:
                events.append(self._event(seq, res.tokens, res.logprobs or None, res.finish_reason, now))
        return events

    def _event(self, seq: Sequence, tokens: list[int], logprobs: list | None, reason: FinishReason | None, now: float) -> TokenEvent:
        """The token event of ``seq``'s new ``tokens``; finishes it when ``reason`` is set."""
        if self.metrics:
            self.metrics.on_token(seq, now, len(tokens))
        ev = TokenEvent(seq.request_id, tokens, logprobs)
        if seq.first_token is None:
            seq.first_token = now
            ev.num_prompt_tokens = seq.num_prompt
            ev.num_cached_tokens = seq.num_cached
            ev.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        seq.last_token = now
        if reason is not None:
            ev.finish_reason = reason
            ev.timing = {
                "queue_s": (seq.first_scheduled or now) - seq.arrival,
                "ttft_s": seq.first_token - seq.arrival,
                "e2e_s": now - seq.arrival,
            }
            ev.num_prompt_tokens = seq.num_prompt
            ev.num_cached_tokens = seq.num_cached
            self._finish(seq, reason, emit=False)
        return ev

    def _save(self, seq: Sequence) -> None:
        """KV-store save; a sequence in a static slot lends its state for it."""
        assert self.kv is not None
        if self.static is not None and self.static.holds(seq):
            if not self.kv.save_due(seq):
                return
            seq.state = self.static.export(seq)
            try:
                self.kv.save(seq, self.model)
            finally:
                seq.state = None
            return
        self.kv.save(seq, self.model)

    def _finish(self, seq: Sequence, reason: str, emit: bool) -> None:
        self.seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        if self.static is not None:
            self.static.release(seq, keep_state=False)
        if self.metrics:
            self.metrics.on_finish(seq, reason)
        if emit:
            self._pending.append(TokenEvent(seq.request_id, finish_reason=reason, num_prompt_tokens=seq.num_prompt))  # type: ignore[arg-type]

    # ---- reporting --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def queued_tokens(self) -> int:
        return sum(s.remaining for s in self.scheduler.waiting + self.scheduler.running)


def _batch_kind(out: SchedulerOutput) -> str:
    """``decode`` when every scheduled row extends a decoding sequence (one new token, or a
    speculative run), ``prefill`` when none does, else ``mixed``."""
    decoding = [seq.num_computed >= seq.num_prompt for seq, _ in out.scheduled]
    return "decode" if all(decoding) else "prefill" if not any(decoding) else "mixed"
