"""One rank process of an expert-parallel reference worker (``deepserve engine --ep N``).

The worker process (``ep_group.py``) starts ``N`` of these; rank ``r`` loads the checkpoint on
``cuda:r`` (NCCL) or the CPU (gloo), keeps its share of the routed experts, and runs its own
``EngineCore`` (data-parallel attention: its own scheduler, sequences and KV connector). The
ranks step in lockstep (``engine.backends.base``: ``lockstep=True``): every turn of every rank's
loop calls ``EPRankBackend.step``, whose first act is the group's agreement on whether anyone has
work (or is stopping); then each rank's core steps, joining the phases it has no rows in
(``engine.parallel.group``).

Pipe traffic (``multiprocessing`` connection, pickled dataclasses): the worker sends ``AddCmd`` /
``AbortCmd`` / ``StopCmd``; the rank answers ``Ready`` (or ``Failed``) once, then a ``RankReport``
after every step that produced events, KV events, a hand-off or a change of load.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deepserve.protocol import GenerateRequest, KVEvent, RankLoad, TokenEvent
from engine.backends.base import BackendContext, Handoff
from engine.backends.reference.backend import ReferenceBackend
from engine.errors import EngineError
from engine.kv_connector import KVConnector
from engine.model.model import DeepseekV4ForCausalLM
from engine.parallel.group import ExpertGroup
from engine.runtime.builder import (
    build_sampler,
    configure_cpu_allocator,
    configure_cpu_threads,
    default_state_budget,
    load_any_model,
)
from engine.runtime.engine_core import EngineCore
from engine.worker.loop import refusal

if TYPE_CHECKING:
    from kvstore.store import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddCmd:
    request: GenerateRequest


@dataclass(frozen=True)
class AbortCmd:
    request_id: str


@dataclass(frozen=True)
class StopCmd:
    pass


@dataclass(frozen=True)
class Ready:
    unit_tokens: int
    fingerprint: str


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass
class RankReport:
    """What one step of a rank produced, for the worker's proxy of that rank."""

    events: list[TokenEvent]
    load: RankLoad
    kv_events: list[KVEvent] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)


class EPRankBackend(ReferenceBackend):
    """A ``ReferenceBackend`` whose ``step`` is the group's: every rank calls it on every turn."""

    def __init__(self, core: EngineCore, group: ExpertGroup) -> None:
        super().__init__(core)
        self.group = group
        self.stopping = False  # this rank wants to stop (set from its pipe)
        self.stopped = False  # some rank stopped: the loop ends (on every rank in the same turn)
        self._group_busy = False

    def step(self) -> list[TokenEvent]:
        busy, stop = self.group.any(self.core.has_work(), self.stopping)
        self._group_busy = busy
        if stop:
            self.stopped = True
            return []
        return super().step() if busy else []

    @property
    def group_busy(self) -> bool:
        """Whether some rank had work at the last step (every rank reads the same value)."""
        return self._group_busy

    def has_work(self) -> bool:
        """Work here, or the group was busy at the last step (so this rank does not idle-wait)."""
        return self.core.has_work() or self._group_busy


def build_rank(ctx: BackendContext, group: ExpertGroup, device: str) -> tuple[EPRankBackend, TieredStore | None]:
    """This rank's engine: the model with its share of the experts, a core, a KV connector."""
    if device == "cpu":
        configure_cpu_threads()
        configure_cpu_allocator()
    model = load_any_model(ctx.model_dir, dtype=ctx.dtype, device=device)
    if not isinstance(model, DeepseekV4ForCausalLM):
        raise EngineError("expert parallelism (--ep) serves the DeepSeek-V4 family only")
    cfg = replace(ctx.engine, role=ctx.role)
    cfg = replace(cfg, state_memory_bytes=default_state_budget(model, cfg))
    store = kv = None
    if cfg.kv_cache != "off":
        from kvstore import KVStoreConfig, build_store

        store = build_store(KVStoreConfig.from_env())
        kv = KVConnector(
            store,
            model,
            read=cfg.kv_cache in ("read", "readwrite"),
            write=cfg.kv_cache in ("write", "readwrite"),
            snapshot_interval_units=cfg.snapshot_interval_units,
            bounded_replay_tokens=cfg.bounded_replay_tokens,
            dp_rank=group.rank,
        )
    core = EngineCore(model, build_sampler(model, ctx.model_dir), cfg, kv=kv, dp_rank=group.rank, ep=group)
    return EPRankBackend(core, group), store


def rank_main(rank: int, world: int, init_method: str, ctx: BackendContext, conn: Connection) -> None:
    """The rank process: join the group, build the engine, serve the pipe until stopped."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    cuda = ctx.device.startswith("cuda")
    device = f"cuda:{rank}" if cuda else "cpu"
    store = None
    try:
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))  # fmt: skip
        group = ExpertGroup()
        backend, store = build_rank(ctx, group, device)
    except Exception as exc:  # noqa: BLE001 (the worker reports it and exits)
        log.exception("rank %d could not start", rank)
        conn.send(Failed(f"rank {rank}: {exc}"))
        return
    kv = backend.core.kv
    conn.send(Ready(backend.core.model.config.unit_tokens, kv.fingerprint if isinstance(kv, KVConnector) else ""))
    try:
        _serve(backend, conn, store)
    finally:
        if store is not None:
            store.close()
        conn.close()
    if cuda:
        # NCCL communicators captured in live CUDA graphs hang destroy_process_group (seen on two
        # H200s, tests/engine/parallel/ep_worker.py): leave without the teardown
        os._exit(0)
    dist.destroy_process_group()


def _serve(backend: EPRankBackend, conn: Connection, store: TieredStore | None) -> None:
    """Commands in, steps, reports out, until some rank stops (every rank leaves in one turn)."""
    kv_events: list[KVEvent] = []
    if store is not None:
        store.subscribe(lambda _seq, ev: kv_events.append(ev))
    last_load = None
    while not backend.stopped:
        idle = not backend.has_work()
        while not backend.stopping and conn.poll(0.01 if idle else 0):  # an idle rank waits a little for commands
            idle = False
            _apply(backend, conn)
        events = backend.step()
        handoffs = [h for ev in events if ev.finished and (h := backend.handoff(ev.request_id)) is not None]
        load = backend.load()
        if events or kv_events or handoffs or load != last_load:
            sent, kv_events[:] = list(kv_events), []
            conn.send(RankReport(events, load, sent, handoffs))
            last_load = load


def _apply(backend: EPRankBackend, conn: Connection) -> None:
    try:
        cmd = conn.recv()
    except EOFError:  # the worker went away: stop with the group
        backend.stopping = True
        return
    if isinstance(cmd, AddCmd):
        try:
            backend.add_request(cmd.request)
        except Exception as exc:  # noqa: BLE001 (one request's failure is that request's)
            conn.send(RankReport([refusal(cmd.request, exc)], backend.load()))
    elif isinstance(cmd, AbortCmd):
        backend.abort_request(cmd.request_id)
    else:
        backend.stopping = True
