"""The router: places each request, sends it, and keeps its stream whole.

``Router.generate(req)`` yields the request's ``TokenEvent``s exactly as one uninterrupted
worker would, whatever happens underneath:

1. **Place** (``placement.Placer``, pure): the first stage is ``prefill`` (disaggregated: prompt
   long enough, prefill and decode pools present) or ``colocated``. The stage's policy picks a
   rank among the available ones below the in-flight cap; if all are at the cap the request
   waits in a bounded priority queue (``admission``), and a full queue or a long wait raises
   ``Overloaded(retry_after)``; no available worker at all raises ``NoWorkerAvailable``.
2. **Send** (``worker_client``): the request goes to the rank with ``dp_rank`` set. A prefill
   stage is sent with ``prefill_only=True``; its first token is streamed to the caller at once,
   then the request goes to a decode rank with ``output_token_ids=[first]``. A prefill worker
   ends a prefill-only request with ``finish_reason="length"`` when it should continue there;
   any other reason (``"stop"``: the first token ended it), or reaching ``max_tokens``, ends it.
3. **Repair**: a worker that fails (cannot connect, 5xx, connection dropped, stream ended with
   no finish event) is reported to the registry (circuit breaker, liveness) and the request is
   re-sent to another rank of the same stage with ``output_token_ids`` = every token streamed so
   far. Before the first token this is a *retry* (``max_retries``; immediate when another worker
   is left, exponential backoff with jitter when only failed ones are); after it a *migration*
   (``max_migrations``): the new worker continues after the streamed tokens, so the caller sees
   no gap and no repeat. A prefill pool with no worker left degrades to colocated placement.
   ``max_tokens`` is the total output length, tokens given in ``output_token_ids`` included.

Errors before the first event are raised (``router.errors``); after it, an unrepairable failure
ends the stream with ``finish_reason="error"`` and the failure's ``error_code`` (a worker's own
error events pass through unchanged). ``abort(request_id)``, or closing the iterator
(client disconnect), stops the request on whichever worker runs it. Prompt statistics
(``num_prompt_tokens``, ``num_cached_tokens``) are those of the first worker that computed the
prompt, also on events from later workers, so usage reports the cache hit the caller got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from deepserve.internal_auth import InternalAuth
from deepserve.protocol import GenerateRequest, LoadReport, RankLoad, TokenEvent
from router.admission import AdmissionQueue
from router.config import RouterConfig
from deepserve.protocol import ErrorCode
from router.errors import NoWorkerAvailable, Overloaded, RequestRejected, RouterError, WorkerError, WorkerUnavailable
from kvstore.keys import chain_keys
from router.metrics import RouterMetrics
from router.placement import Lease, Placer, Pools, Stage
from router.policies.base import Policy, RankView, RouteRequest
from router.policies.registry import create_policy
from router.registry import Worker, WorkerRegistry
from router.transport import HttpError
from router.worker_client import dumps, encode_request, event_from_dict, loads

log = logging.getLogger(__name__)

class WireEvent(NamedTuple):
    """One event as it goes out on the wire: its JSON ``line`` (no newline) and the parsed
    ``fields`` it encodes. Usually the worker's own line, passed through untouched; re-encoded
    only when the router changed a field (prompt statistics after a migration, the prefill
    stage's finish)."""

    line: bytes
    fields: dict[str, Any]

    @property
    def finished(self) -> bool:
        return self.fields.get("finish_reason") is not None


def _wire(ev: TokenEvent) -> WireEvent:
    d = ev.to_dict()
    return WireEvent(dumps(d), d)


@dataclass(eq=False, slots=True)
class _Flight:
    """One request in progress."""

    req: GenerateRequest
    route: RouteRequest
    out: list[int] = field(default_factory=list)  # tokens streamed to the caller (this router)
    worker: Worker | None = None  # where it runs now
    finished: bool = False
    aborted: bool = False
    stats: tuple[int, int] | None = None  # (num_prompt_tokens, num_cached_tokens) first seen
    queue_entry: tuple | None = None
    failed: set[str] | None = None  # worker ids that failed it (a set once one has)
    retries: int = 0  # re-dispatches before the first token
    migrations: int = 0  # re-dispatches after it


class Router:
    """Places requests on workers and streams their tokens back (see module docstring).

    ``config``: the whole router config. ``metrics``: pass one built on the caller's Prometheus
    registry to export ``deepserve_router_*`` there. ``registry``: a prepared worker registry
    (tests); by default one is built from ``config`` and ``auth`` (the internal token sent to
    the workers). Use ``async with Router(cfg) as r`` or ``await start()`` / ``await stop()``.
    """

    def __init__(
        self, config: RouterConfig | None = None, *, metrics: RouterMetrics | None = None, registry: WorkerRegistry | None = None,
        auth: InternalAuth | None = None,
    ) -> None:
        self.config = cfg = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        pc = cfg.policy_config
        self.placer = Placer(
            create_policy(cfg.decode_policy_name, pc),
            create_policy(cfg.prefill_policy_name, pc),
            pd_min_prompt_tokens=cfg.pd_min_prompt_tokens,
            max_inflight_per_rank=cfg.max_inflight_per_rank,
        )
        self.registry = registry or WorkerRegistry(cfg, metrics=self.metrics, poll_kv_events=self.placer.needs_block_keys, auth=auth)
        self.registry.add_listener(self._wake_queue)
        self._hash_prompts = self.placer.needs_block_keys  # read per request: the placer's policies are fixed
        self._fingerprint = cfg.fingerprint  # the workers' model fingerprint, in their unit keys
        self._fp_version = -1  # registry version the fingerprint was read at
        self._queue = AdmissionQueue(cfg.max_queue)
        self._flights: dict[str, _Flight] = {}
        self._pools_cache: tuple[int, Pools] | None = None
        self._rng = random.Random()
        self._ewma_s = 1.0  # request duration average, for Retry-After estimates
        self._bg: set[asyncio.Task] = set()

    # ---- lifecycle and membership ------------------------------------------------------------
    async def start(self) -> None:
        await self.registry.start()

    async def stop(self) -> None:
        for t in list(self._bg):
            t.cancel()
        await self.registry.stop()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def add_worker(self, url: str, role=None) -> str:
        """Register a worker (as ``POST /register`` does); returns its worker_id."""
        return (await self.registry.add(url, role)).worker_id

    async def remove_worker(self, worker_id: str, *, drain: bool = True) -> None:
        await self.registry.remove(worker_id, drain=drain)

    def drain(self, worker_id: str, draining: bool = True) -> None:
        self.registry.drain(worker_id, draining)

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    def healthy(self) -> bool:
        return any(w.available for w in self.registry.workers())

    def load_report(self, router_id: str = "router") -> LoadReport:
        """The cluster as one worker (what the router service answers on ``/load``)."""
        views = [v for w in self.registry.workers() for v in w.ranks]
        rank = RankLoad(
            dp_rank=0,
            running=sum(v.running for v in views),
            waiting=sum(v.waiting for v in views) + len(self._queue),
            queued_tokens=sum(v.queued_tokens for v in views),
            state_usage=max((v.state_usage for v in views), default=0.0),
        )
        limits = [w.max_model_len for w in self.registry.workers() if w.max_model_len]
        return LoadReport(
            worker_id=router_id, role="mixed", ranks=[rank], draining=not self.healthy(), block_size=self.config.block_size,
            max_model_len=min(limits, default=0),  # a request must fit every worker it may be placed on
        )

    # ---- requests ------------------------------------------------------------------------------
    def route_request(self, req: GenerateRequest) -> RouteRequest:
        """What the policies see of ``req``; its unit keys are the engine's (``chain_keys``)."""
        keys: tuple[str, ...] = ()
        prompt, bs = req.prompt_token_ids, self.config.block_size
        if self._hash_prompts and len(prompt) >= bs:
            if self._fp_version != self.registry.version:  # a worker's fingerprint may have changed
                self._fingerprint = self.registry.fingerprint()
                self._fp_version = self.registry.version
            keys = tuple(chain_keys(prompt, bs, self._fingerprint))
        # positional: a NamedTuple's keyword call costs ~0.3 µs more
        return RouteRequest(req.request_id, len(prompt), keys, req.session_key, req.priority, bs, req.sampling.max_tokens)

    def _pools(self) -> Pools:
        reg = self.registry
        if self._pools_cache is None or self._pools_cache[0] != reg.version:
            pools = Pools(prefill=reg.candidates(("prefill",)), decode=reg.candidates(("decode",)), mixed=reg.candidates(("mixed",)))
            self._pools_cache = (reg.version, pools)
        return self._pools_cache[1]

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream ``req``'s events (see module docstring for the guarantees)."""
        async with contextlib.aclosing(self.stream(req)) as events:
            async for w in events:
                yield event_from_dict(w.fields)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[WireEvent]:
        """``generate`` at the wire level: each event's JSON line and fields (what the router
        service sends on, without decoding and re-encoding the worker's lines). Each attempt
        sends the worker ``req`` itself, encoded with the fields the router sets (``dp_rank``,
        ``prefill_only``, and ``output_token_ids`` once tokens were streamed).

        One generator for the whole request (placement, every attempt, repair): a request that
        is one event long costs one generator, not one per layer (each layer adds an
        asynchronous generator object, its registration with the loop and a ``GeneratorExit``
        thrown through it when the caller closes the stream)."""
        t0 = time.perf_counter()
        if req.request_id in self._flights:
            raise RequestRejected(f"request {req.request_id!r} is already in flight")
        flight = _Flight(req, self.route_request(req))
        self._flights[req.request_id] = flight
        try:
            stage = self.placer.first_stage(flight.route, self._pools())
            view = None if len(self._queue) else self._pick(flight, stage, ())
            waited = 0.0
            if view is None:
                view, waited = await self._admit(flight, stage)
                if view is None:  # aborted while queued
                    flight.finished = True
                    yield _wire(TokenEvent(req.request_id, finish_reason="abort"))
                    return
            self.metrics.observe_added_latency(time.perf_counter() - t0 - waited)
            if stage == "prefill":
                self.metrics.disaggregated.inc()
            while True:
                if flight.aborted:
                    flight.finished = True
                    yield _wire(TokenEvent(req.request_id, finish_reason="abort"))
                    return
                worker = self.registry.worker_of(view)
                body, lease, policy = self._dispatch(flight, stage, view, worker)
                client = worker.client
                conn = None
                ok = handoff = False
                failure: RouterError | None = None
                try:
                    try:
                        conn = await client.pool.request("/internal/generate", body)
                        # the lines already in (a one-event answer's: all of it) without a read() coroutine
                        while not handoff and (lines := conn.take() or await conn.read()) is not None:
                            for line in lines:
                                d = loads(line)
                                toks = d.get("token_ids")
                                if toks:
                                    if lease.pending:
                                        lease.first_token()
                                    lease.add_tokens(len(toks))
                                    flight.out.extend(toks)
                                if d.get("num_prompt_tokens"):
                                    if flight.stats is None:
                                        flight.stats = (d["num_prompt_tokens"], d.get("num_cached_tokens", 0))
                                    elif flight.stats != (d["num_prompt_tokens"], d.get("num_cached_tokens", 0)):
                                        d["num_prompt_tokens"], d["num_cached_tokens"] = flight.stats
                                        line = dumps(d)
                                reason = d.get("finish_reason")
                                if reason is None:
                                    if toks:
                                        yield WireEvent(line, d)
                                    continue
                                ok = True
                                self.registry.record_success(worker)
                                if stage == "prefill" and reason == "length" and len(req.output_token_ids) + len(flight.out) < req.sampling.max_tokens:
                                    del d["finish_reason"]  # the request goes on to a decode rank
                                    handoff = True
                                    if toks:
                                        yield WireEvent(dumps(d), d)
                                    break
                                flight.finished = True
                                self.metrics.finished(reason)
                                yield WireEvent(line, d)
                                return
                        if not handoff:
                            raise WorkerUnavailable("stream ended without a finish event", client.url, code=ErrorCode.ENGINE_ERROR)
                    except (HttpError, ValueError) as exc:
                        raise client.error_for(exc) from exc
                    finally:
                        if conn is not None:
                            client.pool.release(conn, ok)  # after the finish event: kept alive
                        lease.release()
                        policy.on_finish(flight.route, view, ok)
                except WorkerError as exc:
                    nxt = await self._recover(flight, stage, worker, exc)
                    if isinstance(nxt, RouterError):
                        failure = nxt
                    else:
                        if nxt is not None:
                            view, stage = nxt
                        continue
                else:  # the prefill stage ended with a first token and the request goes on: decode
                    stage = "decode"
                    try:
                        view = self._pick(flight, stage, flight.failed or (), capped=False)
                        continue
                    except NoWorkerAvailable as exc:
                        if not flight.out:
                            raise
                        failure = exc
                assert failure is not None, "a stream ends on a failure only"
                flight.finished = True
                self.metrics.finished("error")
                yield _wire(TokenEvent(req.request_id, finish_reason="error", error=str(failure), error_code=failure.code))
                return
        finally:
            self._flights.pop(req.request_id, None)
            if not flight.finished and flight.worker is not None:
                self._background(flight.worker.client.abort(req.request_id))
            self._ewma_s += 0.05 * ((time.perf_counter() - t0) - self._ewma_s)
            self._wake_queue()

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it runs; False if the router does not know it."""
        flight = self._flights.get(request_id)
        if flight is None:
            return False
        flight.aborted = True
        if flight.queue_entry is not None and not flight.queue_entry[2].done():
            flight.queue_entry[2].set_result(False)
        if flight.worker is not None:
            await flight.worker.client.abort(request_id)
        return True

    # ---- admission -----------------------------------------------------------------------------
    async def _admit(self, flight: _Flight, stage: Stage) -> tuple[RankView | None, float]:
        """A rank for the first stage once one is below its cap, waiting in the queue meanwhile:
        (view or None if aborted, seconds waited)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.queue_timeout_s
        entry = self._queue.enter(flight.req.priority, self._retry_after())
        self.metrics.queue_depth.set(len(self._queue))
        try:
            while True:
                flight.queue_entry = entry
                try:
                    go = await asyncio.wait_for(entry[2], max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    self._queue.leave(entry)
                    self.metrics.rejected.labels("queue_timeout").inc()
                    raise Overloaded(f"no capacity within {self.config.queue_timeout_s:.0f}s", retry_after=self._retry_after()) from None
                if not go or flight.aborted:
                    return None, time.perf_counter() - t0
                view = self._pick(flight, stage, ())
                if view is not None:
                    self.metrics.queue_wait.observe(time.perf_counter() - t0)
                    self._wake_queue()  # there may be room for the next one too
                    return view, time.perf_counter() - t0
                entry = self._queue.requeue(entry)
        finally:
            flight.queue_entry = None
            self.metrics.queue_depth.set(len(self._queue))

    def _pick(self, flight: _Flight, stage: Stage, exclude: Collection[str], capped: bool = True) -> RankView | None:
        try:
            return self.placer.pick(stage, flight.route, self._pools(), exclude=exclude, capped=capped)
        except NoWorkerAvailable:
            self.metrics.rejected.labels("no_worker").inc()
            raise

    def _wake_queue(self) -> None:
        if len(self._queue):
            self._queue.wake_one()

    def _retry_after(self) -> float:
        slots = max(1, self.config.max_inflight_per_rank * sum(len(w.ranks) for w in self.registry.workers()))
        return min(30.0, max(0.1, self._ewma_s * (len(self._queue) + 1) / slots))

    # ---- sending and repair ------------------------------------------------------------------
    async def _recover(self, flight: _Flight, stage: Stage, worker: Worker, exc: WorkerError) -> tuple[RankView, Stage] | RouterError | None:
        """After ``worker`` failed the request: the (rank, stage) to try next, ``None`` when the
        request was aborted meanwhile, or the error that ends a stream already under way.
        Raises (``RequestRejected``, ``NoWorkerAvailable``) while nothing was streamed yet."""
        cfg = self.config
        if not exc.retryable:
            if not flight.out:
                raise RequestRejected(str(exc), code=exc.code) from exc
            return exc
        self.registry.record_failure(worker, exc)
        if flight.aborted:
            return None
        if flight.failed is None:
            flight.failed = set()
        flight.failed.add(worker.worker_id)
        if flight.out:
            flight.migrations += 1
            if flight.migrations > cfg.max_migrations:
                return RouterError(f"gave up after {cfg.max_migrations} migrations: {exc}", code=exc.code)
            self.metrics.migrations.inc()
            log.info("migrating %s after %d tokens: %s", flight.req.request_id, len(flight.out), exc)
        else:
            flight.retries += 1
            if flight.retries > cfg.max_retries:
                raise NoWorkerAvailable(f"gave up after {cfg.max_retries} retries: {exc}", code=exc.code) from exc
            self.metrics.retries.labels("connect" if exc.connect else "failure").inc()
        try:
            return await self._repick(flight, stage, flight.failed, flight.retries)
        except NoWorkerAvailable as exc2:
            if not flight.out:
                raise
            return exc2

    async def _repick(self, flight: _Flight, stage: Stage, failed: set[str], retries: int) -> tuple[RankView, Stage]:
        """The next rank after a failure (another worker if any is left; backoff if not)."""
        pools = self._pools()
        if stage == "prefill" and not pools.prefill:
            stage = "colocated"  # the prefill pool is gone: compute the prompt where it decodes
        try:
            view = self.placer.pick(stage, flight.route, pools, exclude=failed, capped=False)
        except NoWorkerAvailable:
            view = None
        if view is None or view.worker_id in failed:
            delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** max(0, retries - 1))
            await asyncio.sleep(delay * (0.5 + self._rng.random()))
            pools = self._pools()
            if stage == "prefill" and not pools.prefill:
                stage = "colocated"
            view = self.placer.pick(stage, flight.route, pools, exclude=failed, capped=False)
        assert view is not None
        return view, stage

    def _dispatch(self, flight: _Flight, stage: Stage, view: RankView, worker: Worker) -> tuple[bytes, Lease, Policy]:
        """Book the request on ``view`` (lease, predicted KV units, policy and breaker hooks):
        the body to send, the lease to release and the policy to tell when the attempt ends."""
        req, route = flight.req, flight.route
        prior = req.output_token_ids + flight.out if flight.out else req.output_token_ids
        # positional (request_id, prompt, sampling, priority, output, prefill_only, dp_rank,
        # session_key, arrival_time): the keyword call cost 0.3 µs more
        body = encode_request(
            GenerateRequest(
                req.request_id, req.prompt_token_ids, req.sampling, req.priority, prior, stage == "prefill", view.dp_rank, req.session_key,
                req.arrival_time,
            )
        )
        policy = self.placer.policy_for(stage)
        cached = view.cached_blocks(route.block_keys) * route.block_size if route.block_keys else 0
        lease = Lease(view, route.num_prompt_tokens + len(prior), max(0, route.num_prompt_tokens - cached) if not prior or stage != "decode" else 0)
        if route.block_keys:
            self.registry.index.add_predicted(view.key, route.block_keys)
        policy.on_dispatch(route, view)
        self.registry.dispatched(worker)
        self.metrics.decision(policy.name, stage)
        flight.worker = worker
        return body, lease, policy

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
