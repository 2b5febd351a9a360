"""The discrete-event loop: trace arrivals, the router's own placement code, simulated workers.

What is the router's own code (imported, never copied): ``router.placement.Placer`` and
``Pools`` (stage choice and candidate filtering), the policies from ``router.policies`` (by
registry name), ``router.registry.Lease`` (the router's in-flight accounting on each
``RankView``), ``router.kv_index.KVIndex`` (fed with the ``KVEvent``s simulated workers publish,
and with the router's own predicted placements), ``router.config.RouterConfig`` defaults, and
``kvstore.keys`` unit hashing. What is simulated: time (a heap of events), the workers
(``cluster.py``) and their costs (``cost_model.py``).

The request's path mirrors ``router.router.Router``: place the first stage (``prefill`` when
disaggregated, else ``colocated``); a prefill rank computes the prompt and emits the first token
(TTFT), its lease is released, and the decode stage is placed then (uncapped), the KV handed over
(``transfer_s``) and decoding continues there. When every rank is at ``max_inflight_per_rank``
the request waits in a FIFO until a lease is released. Simplifications, stated: worker load
reports and KV events reach the router instantly (a live router polls them every 0.5 s); no
failures, retries or migrations; decode ranks' own copies of prompts are not indexed.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.simulator.cluster import LRUUnits, SimRank, SimRequest, SimWorker, insert_units
from bench.simulator.cost_model import CostModel
from bench.workloads import BlockContent, TraceRow
from deepserve.protocol import KVEvent
from kvstore.keys import ROOT_KEY, chain_keys, unit_key
from router.config import RouterConfig
from router.kv_index import KVIndex
from router.placement import Lease, Placer, Pools
from router.policies.base import RankView, RouteRequest
from router.policies.registry import create_policy

_ARRIVE, _STEP, _JOIN = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 0  # prefill workers; 0 = colocated serving on the decode (mixed) workers
    decode: int = 1
    dp_size: int = 1  # ranks per worker
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    trace_block_size: int = 512  # tokens per hash id of the trace
    time_scale: float = 1.0  # multiply trace inter-arrival times
    fingerprint: str = "sim"
    content_seed: int = 0
    macro_steps: bool = True  # jump over decode steps between events (False: one event per step; tests)

    def __post_init__(self) -> None:
        assert self.decode >= 1 or self.prefill >= 1, "need at least one worker"
        assert self.dp_size >= 1, "dp_size must be >= 1"


class UnitKeys:
    """Engine unit keys of trace prompts: exactly ``chain_keys`` of the ``BlockContent`` tokens,
    memoised per (parent key, hash id, unit within the block) because trace prompts share long
    prefixes (a 1,024-worker trace would otherwise spend most of its time hashing)."""

    def __init__(self, trace_block: int, unit: int, fingerprint: str, seed: int = 0, max_memo: int = 2_000_000) -> None:
        self.content = BlockContent(trace_block, seed)
        self.trace_block, self.unit, self.fp, self.max_memo = trace_block, unit, fingerprint, max_memo
        self.memo: dict[tuple[str, int, int], str] = {}

    def keys(self, row: TraceRow, idx: int) -> tuple[str, ...]:
        unit, tb = self.unit, self.trace_block
        if tb % unit:
            return tuple(chain_keys(self.content.token_ids(row.hash_ids, row.input_length, idx), unit, self.fp))
        per = tb // unit
        n_units = row.input_length // unit
        hids = row.hash_ids
        memo = self.memo
        if len(memo) > self.max_memo:
            memo.clear()
        keys: list[str] = []
        parent = ROOT_KEY
        tail = None
        for u in range(n_units):
            b, j = divmod(u, per)
            if b < len(hids):
                mk = (parent, hids[b], j)
                k = memo.get(mk)
                if k is None:
                    k = unit_key(parent, self.content.block_token_ids(hids[b])[j * unit : (j + 1) * unit], self.fp)
                    memo[mk] = k
            else:  # past the named blocks: request-unique tokens
                if tail is None:
                    tail = self.content.token_ids(hids, row.input_length, idx)
                k = unit_key(parent, tail[u * unit : (u + 1) * unit], self.fp)
            keys.append(k)
            parent = k
        return tuple(keys)


class Simulation:
    def __init__(self, cfg: SimConfig, cost: CostModel, rows: Sequence[TraceRow]) -> None:
        self.cfg, self.cost, self.rows = cfg, cost, rows
        rc = cfg.router
        self.now = 0.0
        self.index = KVIndex(max_keys=rc.max_index_keys, predicted_ttl_s=rc.predicted_kv_ttl_s, clock=lambda: self.now)
        pc = rc.policy_config
        self.placer = Placer(
            create_policy(cfg.decode_policy or cfg.policy, pc),
            create_policy(cfg.prefill_policy or cfg.policy, pc),
            pd_min_prompt_tokens=rc.pd_min_prompt_tokens,
            max_inflight_per_rank=rc.max_inflight_per_rank,
        )
        self.workers: list[SimWorker] = []
        self.rank_of: dict[tuple[str, int], SimRank] = {}
        pools: dict[str, list[RankView]] = {"prefill": [], "decode": [], "mixed": []}
        decode_role = "decode" if cfg.prefill else "mixed"
        for role, n, prefix in (("prefill", cfg.prefill, "p"), (decode_role, cfg.decode, "d")):
            for i in range(n):
                wid = f"{prefix}{i}"
                views = [RankView(worker_id=wid, dp_rank=r, role=role, dp_size=cfg.dp_size, cache=self.index) for r in range(cfg.dp_size)]  # type: ignore[arg-type]
                w = SimWorker(self, wid, role, views)
                self.workers.append(w)
                for rank in w.ranks:
                    self.rank_of[rank.view.key] = rank
                pools[role].extend(views)
        self.pools = Pools(prefill=pools["prefill"], decode=pools["decode"], mixed=pools["mixed"])
        self.store = LRUUnits(cost.cache.store_tokens // cost.block_size) if cost.cache.store_tokens > 0 else None
        self.unit_keys = UnitKeys(cfg.trace_block_size, cost.block_size, cfg.fingerprint, cfg.content_seed)
        self.requests: list[SimRequest] = []
        self.router_queue: deque[SimRequest] = deque()
        self.router_queue_max = 0
        self._heap: list[tuple[float, int, int, object, int]] = []
        self._seq = itertools.count()
        self.wall_s = 0.0

    # ---- event plumbing -------------------------------------------------------------------------
    def schedule_step(self, worker: SimWorker, t: float) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), _STEP, worker, worker.version))

    def run(self) -> Simulation:
        t0 = time.perf_counter()
        rows = self.rows
        base = rows[0].timestamp if rows else 0.0
        scale = self.cfg.time_scale / 1000.0
        heap = self._heap
        if rows:
            heapq.heappush(heap, (0.0, next(self._seq), _ARRIVE, 0, 0))
        while heap:
            t, _, kind, obj, ver = heapq.heappop(heap)
            self.now = t
            if kind == _STEP:
                if obj.version == ver:  # type: ignore[attr-defined]
                    obj.end_step()  # type: ignore[attr-defined]
            elif kind == _ARRIVE:
                i = obj  # type: ignore[assignment]
                nxt = i + 1
                if nxt < len(rows):
                    heapq.heappush(heap, (max(t, (rows[nxt].timestamp - base) * scale), next(self._seq), _ARRIVE, nxt, 0))
                self._arrive(i, rows[i])  # type: ignore[arg-type]
            else:
                rank, req = obj  # type: ignore[misc]
                rank.worker.enqueue_decode(rank, req)
        self.wall_s = time.perf_counter() - t0
        return self

    # ---- the router's part ----------------------------------------------------------------------
    def _arrive(self, i: int, row: TraceRow) -> None:
        keys = self.unit_keys.keys(row, i)
        req = SimRequest(i, self.now, row.input_length, max(1, row.output_length), keys)
        req.route = RouteRequest(
            request_id=str(i),
            num_prompt_tokens=row.input_length,
            block_keys=keys if self.placer.needs_block_keys and keys else (),
            session_key=row.session_id,
            block_size=self.cost.block_size,
            max_tokens=req.output,
        )
        self.requests.append(req)
        req.stage = self.placer.first_stage(req.route, self.pools)
        if self.router_queue:
            self._enqueue_router(req)
            return
        view = self.placer.pick(req.stage, req.route, self.pools)  # type: ignore[arg-type]
        if view is None:
            self._enqueue_router(req)
        else:
            self._dispatch(req, req.stage, view)

    def _enqueue_router(self, req: SimRequest) -> None:
        self.router_queue.append(req)
        self.router_queue_max = max(self.router_queue_max, len(self.router_queue))

    def _drain_router_queue(self) -> None:
        q = self.router_queue
        while q:
            req = q[0]
            view = self.placer.pick(req.stage, req.route, self.pools)  # type: ignore[arg-type]
            if view is None:
                return
            q.popleft()
            self._dispatch(req, req.stage, view)

    def _dispatch(self, req: SimRequest, stage: str, view: RankView) -> None:
        """What ``Router._attempt`` does before sending: lease, predicted index entries, hook."""
        route = req.route
        assert route is not None
        rank = self.rank_of[view.key]
        prior = 1 if stage == "decode" else 0
        cached = view.cached_blocks(route.block_keys) * route.block_size if route.block_keys else 0
        req.lease = Lease(view, req.prompt + prior, max(0, req.prompt - cached) if stage != "decode" else 0)
        if route.block_keys:
            self.index.add_predicted(view.key, route.block_keys)
        self.placer.policy_for(stage).on_dispatch(route, view)  # type: ignore[arg-type]
        if stage == "decode":
            req.decode_worker = rank.worker.worker_id
            heapq.heappush(self._heap, (self.now + self.cost.transfer_s(req.prompt), next(self._seq), _JOIN, (rank, req), 0))
        else:
            req.prefill_worker = rank.worker.worker_id
            if stage == "colocated":
                req.decode_worker = rank.worker.worker_id
            rank.worker.enqueue_prefill(rank, req)

    def _release(self, req: SimRequest, stage: str, tokens: int) -> None:
        lease = req.lease
        assert lease is not None and req.route is not None
        lease.tokens = tokens  # per-token Lease.add_tokens happened in bulk on the view (cluster._advance)
        lease.release()
        self.placer.policy_for(stage).on_finish(req.route, lease.view, True)  # type: ignore[arg-type]
        req.lease = None
        if self.router_queue:
            self._drain_router_queue()

    # ---- the workers' callbacks -----------------------------------------------------------------
    def lookup_prefix(self, rank: SimRank, req: SimRequest) -> None:
        """The engine finds the prompt's cached prefix when its first chunk is scheduled."""
        bs = self.cost.block_size
        local = rank.cache.match(req.keys) * bs
        shared = 0
        tier = self.cost.cache.store_tier
        if self.store is not None and self.cost.load_s_per_token(tier) < self.cost.prefill.per_token_s:
            shared = max(0, self.store.match(req.keys) * bs - local)
        total = min(local + shared, req.prompt - 1)  # the last prompt token is always computed
        req.cached_local = min(local, total)
        req.cached_shared = total - req.cached_local
        req.computed = total
        req.load_s = req.cached_local * self.cost.load_s_per_token("memory") + req.cached_shared * self.cost.load_s_per_token(tier)
        req.started = True
        rank.queued_tokens -= total
        rank.cached_tokens += total

    def prefill_done(self, rank: SimRank, req: SimRequest) -> None:
        """Prompt computed on ``rank``: first token; cache the units; continue or hand off."""
        req.first_token = self.now
        req.generated = 1
        rank.n_prefills += 1
        wid = rank.worker.worker_id
        events = insert_units(rank, req.keys)
        if self.store is not None:
            stored, evicted = self.store.insert(req.keys)
            tier = self.cost.cache.store_tier
            if stored:
                events.append(KVEvent("stored", stored, tier, rank.dp_rank))
            if evicted:
                events.append(KVEvent("removed", evicted, tier, rank.dp_rank))
        if events:
            self.index.apply(wid, events)
        lease = req.lease
        assert lease is not None
        lease.first_token()
        lease.add_tokens(1)
        if req.output <= 1:
            self._finish(req)
        elif req.stage == "colocated":
            rank.worker.enqueue_decode(rank, req)
        else:
            self._release(req, "prefill", req.prompt + 1)
            view = self.placer.pick("decode", req.route, self.pools, capped=False)  # type: ignore[arg-type]
            assert view is not None
            self._dispatch(req, "decode", view)

    def decode_done(self, rank: SimRank, req: SimRequest) -> None:
        self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        req.finish = self.now
        stage = "decode" if req.stage == "prefill" and req.output > 1 else req.stage
        self._release(req, stage, req.prompt + req.output)


def simulate(cfg: SimConfig, cost: CostModel, rows: Sequence[TraceRow]) -> Simulation:
    """Run a whole trace; the returned simulation holds requests, workers and timings."""
    return Simulation(cfg, cost, rows).run()
