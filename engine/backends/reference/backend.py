"""``ReferenceBackend``: one DP rank of deepserve's ``EngineCore`` as an ``EngineBackend``.

The core does the work; this adds what the interface asks beyond it: the hand-off of a
prefill-only request. The reference engine hands off through the store's cache units: the
prefill saved the prompt's whole units up to its last unit boundary before the final token
(``KVConnector.snapshot_stop``) with a snapshot there, and the decode worker restores those and
recomputes the rest itself.
"""

from __future__ import annotations

from engine.backends.base import Handoff, keep_recent
from engine.kv_connector import KVConnector, snapshot_key
from deepserve.protocol import GenerateRequest, RankLoad, TokenEvent
from engine.runtime.engine_core import EngineCore


class ReferenceBackend:
    """An ``EngineCore`` (one DP rank) with hand-off records for its prefill-only requests."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._prefills: dict[str, GenerateRequest] = {}
        self._handoffs: dict[str, Handoff] = {}

    def add_request(self, req: GenerateRequest) -> None:
        self.core.add_request(req)
        if req.prefill_only and req.request_id in self.core.seqs:
            self._prefills[req.request_id] = req

    def abort_request(self, request_id: str) -> bool:
        self._prefills.pop(request_id, None)
        return self.core.abort_request(request_id)

    def step(self) -> list[TokenEvent]:
        events = self.core.step()
        for ev in events:
            req = self._prefills.pop(ev.request_id, None) if ev.finished else None
            if req is not None and ev.finish_reason in ("length", "stop") and ev.token_ids:
                keep_recent(self._handoffs, ev.request_id, self._units_handoff(req, ev.token_ids[-1]))
        return events

    def _units_handoff(self, req: GenerateRequest, first_token: int) -> Handoff:
        kv = self.core.kv
        if not isinstance(kv, KVConnector) or not kv.write:
            return Handoff(req.request_id, "units", (), 0, first_token)
        units = (len(req.prompt_token_ids) - 1) // kv.unit  # KVConnector.snapshot_stop's boundary
        keys = kv.keys(req.prompt_token_ids)[:units]
        if keys:
            keys.append(snapshot_key(keys[-1]))
        return Handoff(req.request_id, "units", tuple(keys), units * kv.unit, first_token)

    def handoff(self, request_id: str) -> Handoff | None:
        return self._handoffs.pop(request_id, None)

    def has_work(self) -> bool:
        return self.core.has_work()

    def load(self) -> RankLoad:
        c = self.core
        return RankLoad(dp_rank=c.dp_rank, running=c.num_running, waiting=c.num_waiting, queued_tokens=c.queued_tokens, state_usage=c.pool.usage)

    def request_ids(self) -> list[str]:
        return list(self.core.seqs)
