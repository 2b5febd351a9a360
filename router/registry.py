"""The worker registry: who can take work, at which (worker_id, dp_rank), and how loaded.

A ``Worker`` is one engine process (one DP group) at one URL; it owns one ``RankView`` per DP
rank, which policies read. The registry keeps three kinds of state per worker:

- **health**: ``alive`` (answers ``/load``), ``accepting`` (``/health`` is 200 and the load
  report is not draining), the router-side ``admin_draining`` flag, and a ``CircuitBreaker`` fed
  by request outcomes. ``available`` = all four allow new work. A refused connection marks the
  worker dead at once and wakes its poller, so the next poll, not a timeout, brings it back.
- **load**: each poll of ``/load`` rewrites the reported fields of its ``RankView``s; the
  router's own accounting (``Lease``) adds in-flight requests and tokens between polls.
- **cache**: ``/kv_events`` is polled with a cursor and applied to the ``KVIndex``; a worker that
  restarts (cursor went back, or it came back from dead) has its units forgotten, and so does one
  whose answer is ``complete: false`` (the poller fell behind its event ring); both are rebuilt
  from the worker's snapshot (``/kv_events?snapshot=1``).

Workers come from static config (``add(url, role, static=True)``: kept even while unreachable
and polled until they come up) or register themselves (``add(url)``: must answer ``/load``).
``remove(worker_id, drain=True)`` stops new work at once and forgets the worker when its last
request ends. One poller task per worker; everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from deepserve.internal_auth import InternalAuth
from deepserve.protocol import LoadReport, Role
from router.circuit_breaker import CircuitBreaker
from router.config import RouterConfig
from router.errors import RegistrationRefused, RouterError, UnknownWorker, WorkerError
from router.kv_index import KVIndex
from router.metrics import RouterMetrics
from router.policies.base import RankView
from router.worker_client import WorkerClient

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    url: str
    worker_id: str
    role: Role
    client: WorkerClient
    breaker: CircuitBreaker
    ranks: list[RankView] = field(default_factory=list)
    static: bool = False
    alive: bool = False
    accepting: bool = False
    admin_draining: bool = False
    removing: bool = False  # deregistered: forget once idle
    model: str = ""
    fingerprint: str = ""
    block_size: int = 128
    max_model_len: int = 0  # its engine's context length (0: not reported)
    kv_seq: int = 0
    last_load_at: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    @property
    def available(self) -> bool:
        return self.alive and self.accepting and not self.admin_draining and self.breaker.available

    @property
    def draining(self) -> bool:
        return self.admin_draining or (self.alive and not self.accepting)

    @property
    def in_flight(self) -> int:
        return sum(v.in_flight for v in self.ranks)

    def sync_views(self) -> None:
        ok, dr = self.available, self.draining
        for v in self.ranks:
            v.healthy, v.draining, v.role = ok, dr, self.role

    def describe(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "url": self.url,
            "role": self.role,
            "dp": len(self.ranks),
            "alive": self.alive,
            "accepting": self.accepting,
            "draining": self.draining,
            "available": self.available,
            "breaker": self.breaker.state,
            "in_flight": self.in_flight,
            "ranks": [
                {"dp_rank": v.dp_rank, "running": v.running, "waiting": v.waiting, "queued_tokens": v.queued_tokens, "in_flight": v.in_flight, "in_flight_tokens": v.in_flight_tokens}
                for v in self.ranks
            ],
        }


class WorkerRegistry:
    def __init__(
        self, config: RouterConfig, index: KVIndex | None = None, metrics: RouterMetrics | None = None, *, poll_kv_events: bool = True,
        auth: InternalAuth | None = None,
    ) -> None:
        self.config = config
        self.auth = auth or InternalAuth()  # sent to every worker
        self.index = index if index is not None else KVIndex(max_keys=config.max_index_keys, predicted_ttl_s=config.predicted_kv_ttl_s)
        self.metrics = metrics
        self.poll_kv_events = poll_kv_events
        self._workers: dict[str, Worker] = {}
        self._session: aiohttp.ClientSession | None = None
        self._listeners: list[Callable[[], None]] = []
        self.version = 0  # bumped whenever membership or a worker's availability may change
        self._cand_cache: dict[tuple, tuple[int, list[RankView]]] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            from router.worker_client import make_session

            self._session = make_session(self.config.connect_timeout_s, self.auth)
        return self._session

    async def start(self) -> None:
        """Add the statically configured workers and start polling them."""
        static = [(u, "prefill") for u in self.config.prefill] + [(u, "decode") for u in self.config.decode] + [(u, "mixed") for u in self.config.worker]
        await asyncio.gather(*(self.add(url, role, static=True) for url, role in static))

    async def stop(self) -> None:
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._workers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` is called whenever a worker may have become available (capacity appeared)."""
        self._listeners.append(fn)

    def _bump(self) -> None:
        self.version += 1

    def _notify(self) -> None:
        self._bump()
        for fn in self._listeners:
            fn()

    # ---- membership ------------------------------------------------------------------------
    async def add(self, url: str, role: Role | None = None, *, static: bool = False) -> Worker:
        """Register the worker at ``url``; its identity, role and DP size come from ``/load``.

        ``role`` given: it wins over the reported one (the operator's placement intent).
        ``static``: keep it even if unreachable now (polled until it comes up); otherwise an
        unreachable worker is an error (``WorkerUnavailable``).
        """
        url = url.rstrip("/")
        for w in self._workers.values():
            if w.url == url:
                w.admin_draining = w.removing = False
                w.sync_views()
                return w
        cfg = self.config
        client = WorkerClient(url, session=self.session, auth=self.auth, deadlines=cfg.deadlines, transport=cfg.transport)
        breaker = CircuitBreaker(self.config.breaker_failure_threshold, self.config.breaker_cooldown_s)
        worker = Worker(url=url, worker_id=url, role=role or "mixed", client=client, breaker=breaker, static=static)
        worker.ranks = [RankView(worker_id=url, role=worker.role, cache=self.index)]
        try:
            try:
                d = await client.load_dict()
            except WorkerError:
                if not static:
                    raise
                log.warning("worker %s not reachable yet; polling it", url)
            else:
                self._apply_load(worker, d, fixed_role=role)
                worker.accepting = await client.health()
            self._claim(worker)
        except RouterError:
            client.pool.close()
            raise
        worker.sync_views()
        worker.task = asyncio.get_running_loop().create_task(self._poll(worker), name=f"poll {url}")
        self._notify()
        return worker

    def get(self, worker_id: str) -> Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            for w in self._workers.values():
                if w.url == worker_id.rstrip("/"):
                    return w
            raise UnknownWorker(f"no worker {worker_id!r}") from None

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def drain(self, worker_id: str, draining: bool = True) -> None:
        """Stop (or resume) sending new requests to a worker; its running requests go on."""
        w = self.get(worker_id)
        w.admin_draining = draining
        w.sync_views()
        self._bump()
        if not draining:
            self._notify()

    async def remove(self, worker_id: str, *, drain: bool = True) -> None:
        """Deregister: with ``drain`` the worker is forgotten once its requests end."""
        w = self.get(worker_id)
        w.admin_draining = True
        w.sync_views()
        self._bump()
        if drain and w.in_flight > 0:
            w.removing = True
            w.wake.set()
            return
        self._forget(w)

    def _forget(self, w: Worker) -> None:
        self._bump()
        self._workers.pop(w.worker_id, None)
        self.index.remove_worker(w.worker_id)
        if w.task is not None and w.task is not asyncio.current_task():
            w.task.cancel()
        if self.metrics is not None:
            self.metrics.forget_worker(w.worker_id)

    # ---- candidates and outcomes -------------------------------------------------------------
    def candidates(self, roles: tuple[Role, ...]) -> list[RankView]:
        """Ranks of available workers with one of ``roles``, in registration order.

        Cached until ``version`` changes; the list is shared: callers must not mutate it."""
        hit = self._cand_cache.get(roles)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        out = [v for w in self._workers.values() if w.role in roles and w.available for v in w.ranks]
        self._cand_cache[roles] = (self.version, out)
        return out

    def worker_of(self, view: RankView) -> Worker:
        return self._workers[view.worker_id]

    def fingerprint(self) -> str:
        return self.config.fingerprint or next((w.fingerprint for w in self._workers.values() if w.fingerprint), "")

    def dispatched(self, worker: Worker) -> None:
        if worker.breaker.state != "closed":
            worker.breaker.on_dispatch()
            self._bump()  # a half-open breaker's probe slot was taken

    def record_success(self, worker: Worker) -> None:
        if worker.breaker.state != "closed":
            self._bump()
        worker.breaker.record_success()

    def record_failure(self, worker: Worker, exc: WorkerError) -> None:
        if exc.connect:  # nothing listens there: down, not flaky
            worker.alive = False
            worker.breaker.trip()
        else:
            worker.breaker.record_failure()
        worker.sync_views()
        self._bump()
        worker.wake.set()

    # ---- polling ---------------------------------------------------------------------------
    def _apply_load(self, w: Worker, d: dict[str, Any], fixed_role: Role | None = None) -> None:
        report = LoadReport.from_dict(d)
        w.last_load_at = time.monotonic()
        revived = not w.alive
        w.alive = True
        if report.worker_id != w.worker_id or len(report.ranks) != len(w.ranks):
            self._rekey(w, report.worker_id, max(1, len(report.ranks)))
        elif revived and w.kv_seq:
            self.index.remove_worker(w.worker_id)  # it was down: its memory cache is gone
            w.kv_seq = 0
        if fixed_role is None and not w.static:
            w.role = report.role
        elif fixed_role is not None and report.role != fixed_role and report.role != "mixed":
            log.warning("worker %s reports role %s but is configured as %s", w.url, report.role, fixed_role)
        w.model, w.block_size, w.max_model_len = report.model, report.block_size, report.max_model_len
        fp = str(d.get("fingerprint", "") or "")
        if fp != w.fingerprint:
            w.fingerprint = fp
            self._bump()  # the router re-reads fingerprint() when the version moves
        if report.draining:
            w.accepting = False
        by_rank = {r.dp_rank: r for r in report.ranks}
        for v in w.ranks:
            r = by_rank.get(v.dp_rank)
            if r is not None:
                v.running, v.waiting, v.queued_tokens, v.state_usage = r.running, r.waiting, r.queued_tokens, r.state_usage

    def _rekey(self, w: Worker, worker_id: str, dp: int) -> None:
        self._check_id(w, worker_id)
        old = w.worker_id
        registered = self._workers.get(old) is w
        if registered:
            del self._workers[old]
            self.index.remove_worker(old)
        w.worker_id, w.kv_seq = worker_id, 0
        w.ranks = [RankView(worker_id=worker_id, dp_rank=r, role=w.role, dp_size=dp, cache=self.index) for r in range(dp)]
        self._bump()
        if registered:
            self._claim(w)

    def _claim(self, w: Worker) -> None:
        """Enter ``w`` under its id. An older entry with that id that is down is dropped (the
        worker moved); one that is alive stays, and ``w`` is refused (``RegistrationRefused``):
        a worker cannot take over another's id and with it the other's requests."""
        self._check_id(w, w.worker_id)
        other = self._workers.get(w.worker_id)
        if other is not None and other is not w:
            log.warning("worker %s moved from %s to %s", w.worker_id, other.url, w.url)
            self._forget(other)
        self._workers[w.worker_id] = w

    def _check_id(self, w: Worker, worker_id: str) -> None:
        other = self._workers.get(worker_id)
        if other is not None and other is not w and other.alive and not other.removing:
            raise RegistrationRefused(f"worker id {worker_id!r} is held by the live worker at {other.url}")

    async def _poll(self, w: Worker) -> None:
        cfg = self.config
        next_health = next_kv = 0.0
        while True:
            was = (w.available, w.draining, w.role)
            now = time.monotonic()
            try:
                self._apply_load(w, await w.client.load_dict())
                w.client.pool.suspect = False
                if now >= next_health or not w.accepting:
                    w.accepting = await w.client.health()
                    next_health = now + cfg.health_interval_s
                if self.poll_kv_events and now >= next_kv:
                    await self._poll_kv(w)
                    next_kv = now + cfg.kv_events_interval_s
            except (WorkerError, RegistrationRefused) as exc:
                if w.alive:
                    log.warning("worker %s unreachable or refused: %s", w.url, exc)
                w.alive = False
                w.client.pool.suspect = True  # its streams get suspect_timeout_s to show life
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed answer must not kill the poller
                log.exception("polling worker %s failed", w.url)
                w.alive = False
            w.sync_views()
            if self.metrics is not None:
                self.metrics.observe_worker(w)
            if w.removing and w.in_flight == 0:
                self._forget(w)
                return
            if (w.available, w.draining, w.role) != was:
                self._bump()
                if w.available:
                    self._notify()
            w.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(w.wake.wait(), cfg.load_interval_s)

    async def _poll_kv(self, w: Worker) -> None:
        """Apply the worker's KV events since the cursor. When they no longer line up with what
        the index holds (the worker restarted: its cursor went back; or the poller fell further
        behind than the worker's event ring: ``complete`` is false), the worker's units are
        dropped and rebuilt from its snapshot of what it holds now."""
        answer = await w.client.kv_events_raw(w.kv_seq)
        if answer.seq < w.kv_seq or not answer.complete:
            log.info("worker %s: KV events out of step (cursor %d, worker at %d, complete %s): resyncing", w.url, w.kv_seq, answer.seq, answer.complete)
            self.index.remove_worker(w.worker_id)
            answer = await w.client.kv_events_raw(snapshot=True)
        w.kv_seq = answer.seq
        if answer.rows:
            self.index.apply_rows(w.worker_id, answer.rows)
        if answer.events:
            self.index.apply_raw(w.worker_id, answer.events)
