"""The worker side of an expert-parallel reference engine (``deepserve engine --ep N``, N > 1).

The worker process loads no model: it starts ``N`` rank processes (``ep_rank.rank_main``; one per
GPU over NCCL, or gloo processes with ``--device cpu``), waits until each has loaded its share,
and serves them as ``N`` DP ranks of one ``BackendGroup``, each behind a ``RankProxy``. So the
router sees one worker with ``N`` ranks, each with its own load and KV events (``dp_rank``), and
evens the group as it does any DP group (``router.policies.dp``).

The ranks step in lockstep among themselves (``ep_rank``); the worker's engine thread only moves
commands in and reports out, so from its side the group is not lockstep (``lockstep=False``: it
polls a rank's pipe while that rank has requests open).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch

from deepserve.protocol import GenerateRequest, RankLoad, TokenEvent
from engine.backends.base import BackendContext, BackendGroup, Handoff, keep_recent
from engine.backends.reference.ep_rank import AbortCmd, AddCmd, Failed, RankReport, Ready, StopCmd, rank_main
from engine.errors import EngineError
from kvstore.events import KVEventLog

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

POLL_S = 0.002  # how long a rank's proxy waits for its report in one engine-thread turn


class RankProxy:
    """One rank process as an ``EngineBackend`` of the worker: commands down its pipe, token
    events, load and KV events up it. A rank that went away fails every later ``step``."""

    def __init__(self, dp_rank: int, conn: Connection, process: BaseProcess, kv_events: KVEventLog) -> None:
        self.dp_rank = dp_rank
        self.conn = conn
        self.process = process
        self.kv_events = kv_events
        self._open: set[str] = set()
        self._handoffs: dict[str, Handoff] = {}
        self._load = RankLoad(dp_rank=dp_rank, running=0, waiting=0, queued_tokens=0, state_usage=0.0)
        self._gone = False

    def add_request(self, req: GenerateRequest) -> None:
        self._send(AddCmd(req))
        self._open.add(req.request_id)

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self._open:
            return False
        if self._gone:  # nothing to stop any more
            self._open.discard(request_id)
            return True
        self._send(AbortCmd(request_id))
        return True

    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        timeout = POLL_S
        while not self._gone and self.conn.poll(timeout):
            timeout = 0
            try:
                report = self.conn.recv()
            except EOFError:
                self._gone = True
                break
            assert isinstance(report, RankReport), report
            for ev in report.kv_events:
                self.kv_events.publish(ev.kind, ev.keys, ev.tier, ev.dp_rank)
            for h in report.handoffs:
                keep_recent(self._handoffs, h.request_id, h)
            events.extend(report.events)
            self._load = report.load
        for ev in events:
            if ev.finished:
                self._open.discard(ev.request_id)
        if self._gone and not events:
            raise EngineError(f"expert-parallel rank {self.dp_rank} exited")
        return events

    def _send(self, cmd: object) -> None:
        if self._gone:
            raise EngineError(f"expert-parallel rank {self.dp_rank} exited")
        try:
            self.conn.send(cmd)
        except (BrokenPipeError, EOFError, OSError) as exc:
            self._gone = True
            raise EngineError(f"expert-parallel rank {self.dp_rank} exited") from exc

    def has_work(self) -> bool:
        return bool(self._open)

    def load(self) -> RankLoad:
        return self._load

    def request_ids(self) -> list[str]:
        return list(self._open)

    def handoff(self, request_id: str) -> Handoff | None:
        return self._handoffs.pop(request_id, None)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the group to stop (one rank's stop ends every rank's loop) and wait for the process."""
        if not self._gone:
            try:
                self.conn.send(StopCmd())
            except (BrokenPipeError, OSError):
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("expert-parallel rank %d did not stop; terminating it", self.dp_rank)
            self.process.terminate()
            self.process.join(5)


def build_expert_parallel(ctx: BackendContext, registry: CollectorRegistry | None) -> BackendGroup:
    """Start ``ctx.expert_parallel`` rank processes and serve them as that many DP ranks."""
    world = ctx.expert_parallel
    if ctx.dp not in (1, world):
        raise EngineError(f"--dp {ctx.dp} with --ep {world}: each expert-parallel rank is one DP rank (give --dp 1 or {world})")
    if ctx.engine.speculative is not None:
        raise EngineError("speculative decoding is not supported with expert parallelism (--ep)")
    if ctx.device.startswith("cuda") and torch.cuda.device_count() < world:
        raise EngineError(f"--ep {world} needs {world} CUDA devices, {torch.cuda.device_count()} visible")
    mp = torch.multiprocessing.get_context("spawn")
    scratch = tempfile.mkdtemp(prefix="deepserve-ep-")
    init = f"file://{scratch}/rendezvous"
    kv_events = KVEventLog()
    proxies: list[RankProxy] = []
    for rank in range(world):
        mine, theirs = mp.Pipe()
        # not a daemon: a rank compiles grammars in child processes of its own
        proc = mp.Process(target=rank_main, args=(rank, world, init, ctx, theirs), name=f"deepserve-ep-rank{rank}")
        proc.start()
        theirs.close()
        proxies.append(RankProxy(rank, mine, proc, kv_events))

    def close() -> None:
        for p in proxies:
            p.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    ready: list[Ready] = []
    for p in proxies:
        try:
            msg = p.conn.recv()
        except EOFError:
            msg = Failed(f"rank {p.dp_rank} exited while starting (status {p.process.exitcode})")
        if isinstance(msg, Failed):
            for q in proxies:  # the others wait for it in the rendezvous or a collective
                q.process.terminate()
            close()
            raise EngineError(f"expert-parallel worker could not start: {msg.message}")
        ready.append(msg)
    log.info("expert-parallel group of %d ranks ready (%s)", world, ctx.device)
    return BackendGroup(
        ranks=proxies,
        unit_tokens=ready[0].unit_tokens,
        fingerprint=ready[0].fingerprint,
        events=kv_events,
        lockstep=False,
        close=close,
    )
