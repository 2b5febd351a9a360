"""Simulated workers: DP ranks with a prefill queue, continuous batching, a prefix cache.

A ``SimWorker`` is one engine process (one DP group); its ``SimRank``s step in lock-step, so one
step event per worker advances all of them and lasts as long as the busiest rank's work (see
``cost_model``). Each step:

1. admits waiting decode sequences (batch and KV-capacity limits) at the step boundary;
2. takes a chunk of queued prompt tokens per rank (chunked prefill, ``max_batch_tokens``), looking
   a prompt up in the rank's prefix cache and the shared store when its first chunk starts;
3. decodes one token for every running sequence.

When no rank has prompt work, steps are *macro-stepped*: the worker jumps straight to the step
where its next sequence finishes (step ``i`` lasts ``a + g * i`` as context grows by the batch each
step, so ``k`` steps take ``k * a + g * k * (k - 1) / 2``). New work arriving meanwhile cuts the
jump at the next step boundary (``kick``). Sequences finish in order of a per-worker step counter
(``finish_step``), so a jump costs O(finishing sequences), not O(batch x steps).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepserve.protocol import KVEvent
from router.policies.base import RankView, RouteRequest

if TYPE_CHECKING:
    from bench.simulator.sim import Simulation
    from router.placement import Lease


@dataclass(eq=False, slots=True)
class SimRequest:
    """One trace request moving through the simulated cluster (times in simulated seconds)."""

    idx: int
    arrival: float
    prompt: int
    output: int
    keys: tuple[str, ...]  # engine units of the prompt (kvstore.keys.chain_keys)
    route: RouteRequest | None = None
    stage: str = "colocated"  # first stage: "prefill" (disaggregated) or "colocated"
    lease: Lease | None = None
    # prefill progress
    started: bool = False
    computed: int = 0  # prompt tokens in KV on the prefill rank (cached + computed so far)
    cached_local: int = 0
    cached_shared: int = 0
    load_s: float = 0.0  # KV load time still to charge (first chunk)
    # decode progress
    generated: int = 0
    join_step: int = 0
    finish_step: int = 0
    # results
    prefill_worker: str | None = None
    decode_worker: str | None = None
    first_token: float | None = None
    finish: float | None = None


class LRUUnits:
    """An LRU set of unit keys with a capacity in units; reports what a lookup/insert changed."""

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[str, None] = OrderedDict()

    def match(self, keys: tuple[str, ...]) -> int:
        """Leading units held (touching them)."""
        n = 0
        d = self.keys
        for k in keys:
            if k not in d:
                break
            d.move_to_end(k)
            n += 1
        return n

    def insert(self, keys: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """(stored, evicted) after inserting ``keys`` as most recently used."""
        d = self.keys
        stored = []
        for k in keys:
            if k in d:
                d.move_to_end(k)
            else:
                d[k] = None
                stored.append(k)
        evicted = []
        while len(d) > self.capacity:
            evicted.append(d.popitem(last=False)[0])
        return stored, evicted


class SimRank:
    __slots__ = (
        "cache",
        "cached_tokens",
        "ctx_sum",
        "dp_rank",
        "max_running",
        "n_decodes",
        "n_prefills",
        "prefill_q",
        "prefill_tokens",
        "queued_tokens",
        "running",
        "stats_tokens",
        "view",
        "waiting",
        "worker",
    )

    def __init__(self, worker: SimWorker, dp_rank: int, view: RankView, cache_units: int) -> None:
        self.worker = worker
        self.dp_rank = dp_rank
        self.view = view
        self.prefill_q: deque[SimRequest] = deque()
        self.queued_tokens = 0  # prompt tokens still to compute in prefill_q
        self.running: set[SimRequest] = set()
        self.waiting: deque[SimRequest] = deque()  # decode sequences waiting for batch room
        self.ctx_sum = 0  # context tokens of running sequences
        self.cache = LRUUnits(cache_units)
        self.n_prefills = self.n_decodes = self.prefill_tokens = self.cached_tokens = self.max_running = 0
        self.stats_tokens = 0  # output tokens decoded here

    def sync_view(self) -> None:
        """The worker's ``/load`` report, as the router would see it (instantly: no poll delay)."""
        v = self.view
        v.running = len(self.running)
        v.waiting = len(self.prefill_q) + len(self.waiting)
        v.queued_tokens = self.queued_tokens


class SimWorker:
    """One DP group: ranks stepping together (see module docstring)."""

    def __init__(self, sim: Simulation, worker_id: str, role: str, views: list[RankView]) -> None:
        self.sim = sim
        self.cost = sim.cost
        self.worker_id = worker_id
        self.role = role
        units = max(1, self.cost.cache.hbm_tokens_per_rank // self.cost.block_size)
        self.ranks = [SimRank(self, i, v, units) for i, v in enumerate(views)]
        self.step_count = 0  # decode steps so far (every running sequence gains a token per step)
        self.finish_heap: list[tuple[int, int, SimRequest, SimRank]] = []
        self.busy = False
        self.version = 0  # bumped to invalidate a scheduled step end
        self.macro = False
        self.seg_start = self.seg_a = self.seg_g = 0.0
        self.seg_k = 0
        self.plan: list[tuple[SimRank, SimRequest, int]] = []  # prompt chunks of the current step
        self.decoding = False  # current (single) step decodes
        self.step_started = 0.0
        self.busy_time = 0.0
        self.steps = 0

    # ---- work arriving --------------------------------------------------------------------------
    def enqueue_prefill(self, rank: SimRank, req: SimRequest) -> None:
        rank.prefill_q.append(req)
        rank.queued_tokens += req.prompt - req.computed
        rank.sync_view()
        self.kick()

    def enqueue_decode(self, rank: SimRank, req: SimRequest) -> None:
        rank.waiting.append(req)
        rank.sync_view()
        self.kick()

    def kick(self) -> None:
        """New work: start stepping if idle; cut a macro jump at the next step boundary."""
        if not self.busy:
            self.start_step()
        elif self.macro:
            elapsed = self.sim.now - self.seg_start
            k = self._steps_within(elapsed) + 1
            if k < self.seg_k:
                self.seg_k = k
                self.version += 1
                self.sim.schedule_step(self, self.seg_start + self._seg_time(k))

    # ---- stepping -------------------------------------------------------------------------------
    def _seg_time(self, k: int) -> float:
        return k * self.seg_a + self.seg_g * k * (k - 1) / 2

    def _steps_within(self, elapsed: float) -> int:
        """Whole steps of the current segment completed within ``elapsed`` seconds."""
        a, g = self.seg_a, self.seg_g
        if g <= 0:
            k = int(elapsed / a) if a > 0 else self.seg_k
        else:  # g/2 k^2 + (a - g/2) k - elapsed = 0
            b = a - g / 2
            k = int((-b + math.sqrt(b * b + 2 * g * elapsed)) / g)
        while k > 0 and self._seg_time(k) > elapsed:
            k -= 1
        while self._seg_time(k + 1) <= elapsed:
            k += 1
        return k

    def _admit_waiting(self) -> None:
        d = self.cost.decode
        for rank in self.ranks:
            changed = False
            while rank.waiting and len(rank.running) < d.max_batch:
                req = rank.waiting[0]
                ctx = req.prompt + req.generated
                if rank.running and rank.ctx_sum + ctx > d.kv_capacity_tokens:
                    break
                rank.waiting.popleft()
                rank.running.add(req)
                rank.ctx_sum += ctx
                rank.n_decodes += 1
                req.join_step = self.step_count
                req.finish_step = self.step_count + (req.output - req.generated)
                heapq.heappush(self.finish_heap, (req.finish_step, req.idx, req, rank))
                changed = True
            if changed:
                rank.max_running = max(rank.max_running, len(rank.running))
                rank.sync_view()

    def start_step(self) -> None:
        now = self.sim.now
        self._admit_waiting()
        cost = self.cost
        pf = cost.prefill
        plan: list[tuple[SimRank, SimRequest, int]] = []
        prefill_s = 0.0
        for rank in self.ranks:
            if not rank.prefill_q:
                continue
            budget = pf.max_batch_tokens - len(rank.running)
            rank_s = 0.0
            for req in rank.prefill_q:
                if budget <= 0:
                    break
                if not req.started:
                    self.sim.lookup_prefix(rank, req)
                n = min(budget, req.prompt - req.computed)
                rank_s += cost.prefill_chunk_s(n, req.computed) + req.load_s
                req.load_s = 0.0
                plan.append((rank, req, n))
                budget -= n
            prefill_s = max(prefill_s, rank_s)
        busiest_b = max(len(r.running) for r in self.ranks)
        if plan or (busiest_b > 0 and not self.sim.cfg.macro_steps):
            dur = pf.fixed_s + prefill_s if plan else 0.0
            self.decoding = busiest_b > 0
            if self.decoding:
                top = max(self.ranks, key=lambda r: r.ctx_sum)
                dur += cost.decode_step_s(busiest_b, top.ctx_sum)
            self.plan = plan
            self.macro = False
        elif busiest_b > 0:
            top = max(self.ranks, key=lambda r: r.ctx_sum)
            self.seg_a = cost.decode_step_s(busiest_b, top.ctx_sum)
            self.seg_g = cost.decode.per_ctx_token_s * len(top.running)
            self.seg_k = max(1, self.finish_heap[0][0] - self.step_count)
            self.seg_start = now
            self.macro = True
            dur = self._seg_time(self.seg_k)
        else:
            self.busy = False
            self.macro = False
            return
        self.busy = True
        self.step_started = now
        self.version += 1
        self.sim.schedule_step(self, now + dur)

    def end_step(self) -> None:
        """The scheduled step (or macro jump) is over: account for it, then start the next."""
        self.busy_time += self.sim.now - self.step_started
        if self.macro:
            self._advance(self.seg_k)
        else:
            if self.decoding:
                self._advance(1)
            plan, self.plan = self.plan, []
            for rank, req, n in plan:
                req.computed += n
                rank.queued_tokens -= n
                rank.prefill_tokens += n
                if req.computed >= req.prompt:
                    rank.prefill_q.remove(req)
                    rank.sync_view()
                    self.sim.prefill_done(rank, req)
        self.busy = False
        self.start_step()

    def _advance(self, k: int) -> None:
        """``k`` decode steps happened: every running sequence gained ``k`` tokens."""
        self.step_count += k
        self.steps += k
        for rank in self.ranks:
            b = len(rank.running)
            if b:
                rank.ctx_sum += k * b
                rank.view.in_flight_tokens += k * b  # the router's Lease.add_tokens, in bulk
                rank.stats_tokens += k * b
        heap = self.finish_heap
        while heap and heap[0][0] <= self.step_count:
            _, _, req, rank = heapq.heappop(heap)
            rank.running.discard(req)
            req.generated = req.output
            rank.ctx_sum -= req.prompt + req.output
            rank.sync_view()
            self.sim.decode_done(rank, req)


def insert_units(rank: SimRank, keys: tuple[str, ...]) -> list[KVEvent]:
    """Put a computed prompt's units in the rank's cache; the KV events a worker would publish."""
    stored, evicted = rank.cache.insert(keys)
    evs = []
    if stored:
        evs.append(KVEvent("stored", stored, "memory", rank.dp_rank))
    if evicted:
        evs.append(KVEvent("removed", evicted, "memory", rank.dp_rank))
    return evs
