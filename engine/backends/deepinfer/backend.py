"""``DeepInferBackend``: one DeepInfer engine (one DP rank process) as an ``EngineBackend``.

Requests in: ``GenerateRequest`` → ``add_request`` with mapped sampling
(``sampling.to_deepinfer``), ``chunk_checkpoints`` at the prompt's last whole unit (so its
snapshot point ends a chunk), and:

- a prefix hit (mixed, prefill): ``add_request(enqueue=False)``, ``scheduler.try_allocate_seq``,
  the hit's blocks and windows written into the allocated block and slot, ``num_cached_tokens`` /
  ``cached_hit_tokens`` set, then ``scheduler.add_sequence``;
- a decode stage (decode role, ``output_token_ids=[first]``): the hand-off record is read,
  ``add_request(enqueue=False)`` + ``try_allocate_seq``, record written in, ``num_cached_tokens``
  = prompt length, ``last_output_token`` = the first token, status RUNNING, appended to
  ``scheduler.running`` (a COMPLETION engine never prefills). No record: the request fails.

Tokens out: ``RawOutput``s → ``TokenEvent``s. With zero-overhead scheduling a step returns the
previous step's tokens; the step after the last request's last step calls
``flush_inflight_reqs``. An aborted request gets its ``abort`` event at the next step and any
token still in flight for it is dropped. DeepInfer's finish words map to deepserve's; a finish it
reports for another cause (preempted on a decode engine, structured-output or vision failure) is
an ``error`` event naming it. A prefill-role request ends with ``length`` on its first token (the
router continues it on a decode worker) and leaves a ``Handoff``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backends.base import Handoff
from engine.backends.deepinfer.bridge import save_point
from engine.backends.deepinfer.engines import Hooks, RawOutput
from engine.backends.deepinfer.sampling import to_deepinfer
from engine.errors import CapacityError, ContextLengthExceeded, EngineError, InvalidRequestError
from deepserve.protocol import FinishReason, GenerateRequest, RankLoad, Role, TokenEvent, TokenLogprob
from engine.runtime.metrics import EngineMetrics

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "FINISHED_STOPPED": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "length",
}


@dataclass(frozen=True)
class DeepInferTypes:
    """The DeepInfer classes the backend constructs or compares with (the real ones or a stand-in)."""

    sampling_params: Callable[..., Any]  # deepinfer.sampling_params.SamplingParams
    running_status: Any  # deepinfer._C.engine.SequenceStatus.RUNNING


@dataclass
class _Live:
    """deepserve's bookkeeping of one request inside DeepInfer."""

    request: GenerateRequest
    num_cached: int
    first_sent: bool = False


class DeepInferBackend:
    """One DeepInfer engine of role ``role`` serving DP rank ``hooks.dp_rank``."""

    def __init__(
        self,
        engine: Any,
        hooks: Hooks,
        role: Role,
        surface: DeepInferTypes,
        max_model_len: int,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.types = surface
        self.hooks = hooks
        self.role = role
        self.max_model_len = max_model_len
        self.metrics = metrics
        self._live: dict[str, _Live] = {}
        self._pending: list[TokenEvent] = []
        hooks.load = RankLoad(dp_rank=hooks.dp_rank)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> None:
        rid = req.request_id
        if rid in self._live:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        if not req.prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        if self.role == "prefill" and not req.prefill_only:
            raise InvalidRequestError("a prefill deepinfer engine only takes prefill_only requests")
        if self.role != "prefill" and req.prefill_only:
            raise InvalidRequestError("prefill_only requests go to a prefill deepinfer engine (--role prefill)")
        if self.role == "decode" and len(req.output_token_ids) != 1:
            raise InvalidRequestError("a decode deepinfer engine continues a prefill: output_token_ids must hold its first token only")
        if self.role != "decode" and req.output_token_ids:
            raise InvalidRequestError("the deepinfer backend cannot resume after output_token_ids on a mixed or prefill engine")
        if len(req.prompt_token_ids) + req.sampling.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the context length {self.max_model_len}")
        remaining = req.sampling.max_tokens - len(req.output_token_ids)
        if remaining <= 0:
            self._pending.append(TokenEvent(rid, finish_reason="length", num_prompt_tokens=len(req.prompt_token_ids)))
            return
        params = self.engine_sampling(req, remaining)
        prompt = np.asarray(req.prompt_token_ids, dtype=np.int32)
        h = self.hooks
        cached = self._decode_stage(req, params, prompt) if self.role == "decode" else self._prefill_stage(req, params, prompt)
        self._live[rid] = _Live(req, cached)
        h.tokens[rid] = list(req.prompt_token_ids) + list(req.output_token_ids)
        h.prompt_len[rid] = len(req.prompt_token_ids)
        if self.role == "decode":
            h.prompt_saved.add(rid)  # stored by the prefill side
        if self.metrics is not None:
            self.metrics.on_arrival(len(req.prompt_token_ids))
            self.metrics.on_prefix_lookup(len(req.prompt_token_ids), cached)

    def engine_sampling(self, req: GenerateRequest, remaining: int) -> Any:
        """DeepInfer's ``SamplingParams`` for ``req`` (raises ``UnsupportedSampling``)."""
        return self.types.sampling_params(**to_deepinfer(req.sampling, remaining).kwargs())

    def _checkpoints(self, prompt_len: int, cached: int) -> list[int] | None:
        stop = save_point(prompt_len)
        return [stop] if self.hooks.bridge is not None and stop > cached else None

    def _prefill_stage(self, req: GenerateRequest, params: Any, prompt: np.ndarray) -> int:
        """Add a request that prefills here; the tokens restored from the store."""
        e, bridge, rid = self.engine, self.hooks.bridge, req.request_id
        hit = bridge.lookup(req.prompt_token_ids) if bridge is not None else None
        if hit is None:
            if e.add_request("deepserve", rid, params, prompt, chunk_checkpoints=self._checkpoints(len(prompt), 0)) is None:
                raise InvalidRequestError("token id outside the vocabulary")
            return 0
        seq = e.add_request("deepserve", rid, params, prompt, enqueue=False, chunk_checkpoints=self._checkpoints(len(prompt), hit.num_tokens))
        if seq is None:
            raise InvalidRequestError("token id outside the vocabulary")
        cached = 0
        if e.scheduler.try_allocate_seq(seq):
            bridge.restore(seq, hit)  # type: ignore[union-attr]
            seq.num_cached_tokens = seq.cached_hit_tokens = cached = hit.num_tokens
        e.scheduler.add_sequence(seq)
        return cached

    def _decode_stage(self, req: GenerateRequest, params: Any, prompt: np.ndarray) -> int:
        """Inject a prefilled request from its hand-off record (a COMPLETION engine)."""
        e, bridge, rid = self.engine, self.hooks.bridge, req.request_id
        record = bridge.fetch_handoff(rid) if bridge is not None else None
        if record is None:
            raise EngineError(f"no prefill hand-off record for request {rid!r} (a decode engine cannot prefill)")
        if record.header.token_end != len(prompt) or record.header.meta.get("first_token") != req.output_token_ids[0]:
            raise EngineError(f"the hand-off record of {rid!r} is for another prompt or first token")
        seq = e.add_request("deepserve", rid, params, prompt, enqueue=False)
        if seq is None:
            raise InvalidRequestError("token id outside the vocabulary")
        if not e.scheduler.try_allocate_seq(seq):
            raise CapacityError("decode engine full: no blocks for the hand-off")
        bridge.inject(seq, record)  # type: ignore[union-attr]
        seq.num_cached_tokens = len(prompt)
        seq.last_output_token = req.output_token_ids[0]
        seq.status = self.types.running_status
        e.scheduler.running = [*e.scheduler.running, seq]
        return 0

    def abort_request(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        self.engine.abort_request(request_id)
        self.hooks.forget(request_id)
        self._pending.append(TokenEvent(request_id, finish_reason="abort", num_prompt_tokens=len(live.request.prompt_token_ids), num_cached_tokens=live.num_cached))
        return True

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One engine step (every rank of a lockstep group calls it on every turn)."""
        events, self._pending = self._pending, []
        if self.engine.has_unfinished_requests():  # the DP group's all-reduce
            self.engine.step()
        else:
            self.engine.flush_inflight_reqs()  # the tokens still in flight (zero-overhead scheduling)
        outputs, self.hooks.outputs = self.hooks.outputs, []
        for out in outputs:
            ev = self._event(out)
            if ev is not None:
                events.append(ev)
        if self.metrics is not None:
            load = self.hooks.load
            for family, value in ((self.metrics.f.waiting, load.waiting), (self.metrics.f.running, load.running), (self.metrics.f.kv_usage, load.state_usage)):
                family.labels(**self.metrics.labels).set(value)
        return events

    def _event(self, out: RawOutput) -> TokenEvent | None:
        live = self._live.get(out.request_id)
        if live is None:
            return None  # aborted (its event is out) or not ours: a token still in flight
        req = live.request
        tokens = self.hooks.tokens.get(out.request_id)
        if tokens is not None:  # (freed already when DeepInfer finalised it before its lagged output)
            tokens.append(out.token_id)
        lp = [TokenLogprob(out.logprob, out.top[: req.sampling.top_logprobs])] if req.sampling.logprobs else None
        ev = TokenEvent(out.request_id, [out.token_id], lp)
        if not live.first_sent:
            live.first_sent = True
            ev.num_prompt_tokens, ev.num_cached_tokens = len(req.prompt_token_ids), live.num_cached
        reason: FinishReason | None = None
        if out.finished:
            reason = _FINISH.get(out.finish_reason, "error")
            if reason == "error":
                ev.error = f"deepinfer ended the request: {out.finish_reason}"
        elif req.prefill_only:
            reason = "length"  # continued by a decode worker from the hand-off record
        if reason is not None:
            ev.finish_reason = reason
            ev.num_prompt_tokens, ev.num_cached_tokens = len(req.prompt_token_ids), live.num_cached
            del self._live[out.request_id]
            self.hooks.forget(out.request_id)
        if self.metrics is not None:
            self.metrics.f.generation_tokens.labels(**self.metrics.labels).inc()
            if reason is not None:
                self.metrics.f.finished.labels(**self.metrics.labels, finished_reason=reason).inc()
        return ev

    # ---- reporting --------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._live) or bool(self._pending)

    def load(self) -> RankLoad:
        return self.hooks.load

    def request_ids(self) -> list[str]:
        return list(self._live)

    def handoff(self, request_id: str) -> Handoff | None:
        return self.hooks.shipped.pop(request_id, None)
