"""Cache-aware placement: the rank where this request costs least, without piling load.

Cost of placing request R (P prompt tokens, prompt units k_1..k_n of ``block_size`` B) on rank r::

    saved(r)    = B * L_r + B * max(0, S - L_r) * shared_hit_weight      (capped at P)
    uncached(r) = P - saved(r)
    cost(r)     = prefill_weight * (prefill_backlog(r) + uncached(r))
                + decode_weight  * decode_tokens(r)

``L_r``: leading units of the prompt in rank r's own tiers; ``S``: leading units in a shared tier
(Redis, shared FS) that any rank can load, worth ``shared_hit_weight`` of a local hit because
loading is cheaper than recomputing but not free. Both come from ``router.kv_index.KVIndex``
(KV events polled from the workers, plus this router's own recent placements), at the engine's
128-token units, so a hit counted here is one the engine can deliver. ``prefill_backlog`` is the
prompt work queued ahead of R (our TTFT); ``decode_tokens`` the context of the sequences the rank
decodes (its inter-token latency). All terms are in tokens, so the weights are dimensionless.

Temperature 0 takes the argmin (ties: fewer requests, then candidate order); a temperature T > 0
samples with probability ∝ exp(-z / T), z = (cost - min) / (max - min), which spreads a hot
prefix instead of sending all of it to one rank.

Guards, applied before the cost so cache affinity can never pile load on one rank:

1. DP groups (a worker with dp > 1 whose ranks step together, see ``policies/dp.py``): each
   group offers its *even* rank (``dp.pick_rank``, what keeps its sequences and tokens even),
   plus any rank that holds more of this prompt than the even rank, provided it is inside the
   group's band: at most ``dp_seq_slack`` more sequences than the least busy rank and at most
   ``dp_token_slack`` more tokens than the lightest. Ranks are then scored jointly across all
   workers, so the cost picks worker and rank together, but a prefix can pull a request off the
   even rank only by a bounded amount and only to a rank that really holds more of it.
2. Load guard: a rank whose request count exceeds the minimum by more than
   ``balance_abs_threshold`` *and* by a factor ``balance_rel_threshold`` is dropped; the least
   loaded ranks always stay, so under imbalance this degenerates to least load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from operator import attrgetter

from router.policies.base import ASSUMED_CONTEXT_TOKENS, Policy, PrefixMatch, RankView, RouteRequest
from router.policies.dp import even_band, group_by_worker, pick_rank

_NO_MATCH = PrefixMatch(local={}, shared=0)
_worker_id = attrgetter("worker_id")


class CacheAware(Policy):
    name = "cache_aware"
    needs_block_keys = True

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)
        self._distinct_of: tuple[RankView, ...] | None = None  # see _distinct_workers

    def eligible(self, request: RouteRequest, candidates: Sequence[RankView]) -> list[RankView]:
        """Candidates that pass the DP-group and load guards (never empty)."""
        cfg = self.config
        if len({v.worker_id for v in candidates}) == len(candidates):
            out: Sequence[RankView] = candidates  # one rank per worker: no DP guard to apply
        else:
            out = self._dp_eligible(request, candidates)
        if len(out) == 1:
            return [out[0]]
        loads = [v.num_requests for v in out]
        lo = min(loads)
        limit = max(lo + cfg.balance_abs_threshold, lo * cfg.balance_rel_threshold)
        return [v for v, n in zip(out, loads) if n <= limit]

    def _dp_eligible(self, request: RouteRequest, candidates: Sequence[RankView]) -> list[RankView]:
        cfg = self.config
        out: list[RankView] = []
        keys = request.block_keys
        for ranks in group_by_worker(candidates).values():
            if len(ranks) == 1:
                out.append(ranks[0])
                continue
            even = pick_rank(ranks, request.num_prompt_tokens, cfg.dp_seq_slack)
            out.append(even)
            if keys:
                base = even.cached_blocks(keys)
                lo_tok = min(v.token_load for v in ranks)
                for v in even_band(ranks, cfg.dp_seq_slack):
                    if v is not even and v.token_load <= lo_tok + cfg.dp_token_slack and v.cached_blocks(keys) > base:
                        out.append(v)
        return out

    def costs(self, request: RouteRequest, ranks: Sequence[RankView]) -> list[float]:
        """The cost of each rank (see module docstring), in tokens."""
        cfg = self.config
        cache = ranks[0].cache
        m = cache.match(request.block_keys) if cache is not None and request.block_keys else _NO_MATCH
        bs, p = request.block_size, request.num_prompt_tokens
        local_of, shared = m.local.get, m.shared
        hit_w, pw, dw = cfg.shared_hit_weight, cfg.prefill_weight, cfg.decode_weight
        out = []
        for v in ranks:
            local = local_of(v.key, 0) if m.local else 0
            saved = bs * local + (bs * (shared - local) * hit_w if shared > local else 0.0)
            uncached = p - saved if saved < p else 0.0
            out.append(pw * (v.prefill_backlog + uncached) + dw * v.decode_tokens)
        return out

    def select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        if len(candidates) == 1:
            return candidates[0]
        if self.config.temperature > 0 or not self._distinct_workers(candidates):
            return self._select(request, candidates)
        return self._select_one_rank_per_worker(request, candidates)

    def _distinct_workers(self, candidates: Sequence[RankView]) -> bool:
        """Whether no worker offers two of ``candidates``. Remembered for the last tuple seen
        (the router passes its pools' tuple, the same one until the registry changes: a tuple
        cannot change under the memo)."""
        if candidates is self._distinct_of:
            return True
        distinct = len(set(map(_worker_id, candidates))) == len(candidates)
        if distinct and type(candidates) is tuple:
            self._distinct_of = candidates
        return distinct

    def _select_one_rank_per_worker(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        """``_select`` when no worker offers two ranks (no DP guard) at temperature 0: the load
        guard, the cost and the argmin in two short loops over the candidates (same choice, ties
        too; tests/router/test_policies.py compares). ``RankView``'s ``num_requests``,
        ``prefill_backlog`` and ``decode_tokens`` are computed inline from its fields (a
        property call per rank and measure was a third of this function's time)."""
        cfg = self.config
        loads = []
        for v in candidates:
            n = v.running + v.waiting
            loads.append(n if n > v.in_flight else v.in_flight)
        lo = min(loads)
        limit = max(lo + cfg.balance_abs_threshold, lo * cfg.balance_rel_threshold)
        keys = request.block_keys
        cache = candidates[0].cache
        m = cache.match(keys) if keys and cache is not None else _NO_MATCH
        local_of, shared = m.local.get if m.local else None, m.shared
        bs, p = request.block_size, request.num_prompt_tokens
        hit_w, pw, dw = cfg.shared_hit_weight, cfg.prefill_weight, cfg.decode_weight
        best, best_c, best_n = None, 0.0, 0
        for v, n in zip(candidates, loads):
            if n > limit:
                continue
            if local_of is None and not shared:
                uncached = p  # nothing of the prompt cached anywhere (a new prompt)
            else:
                local = local_of(v.key, 0) if local_of is not None else 0
                saved = bs * local + (bs * (shared - local) * hit_w if shared > local else 0.0)
                uncached = p - saved if saved < p else 0.0
            q, pending = v.queued_tokens, v.pending_prefill_tokens
            unseen = v.running - v.in_flight
            decode = v.in_flight_tokens + (unseen * ASSUMED_CONTEXT_TOKENS if unseen > 0 else 0)
            c = pw * ((q if q > pending else pending) + uncached) + dw * decode
            if best is None or c < best_c or (c == best_c and n < best_n):
                best, best_c, best_n = v, c, n
        return best

    def _select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        ranks = self.eligible(request, candidates)
        if len(ranks) == 1:
            return ranks[0]
        costs = self.costs(request, ranks)
        if self.config.temperature > 0:
            return ranks[self._sample(costs)]
        best, best_key = 0, (costs[0], ranks[0].num_requests)
        for i in range(1, len(ranks)):
            c = costs[i]
            if c <= best_key[0]:
                key = (c, ranks[i].num_requests)
                if key < best_key:
                    best, best_key = i, key
        return ranks[best]

    def _sample(self, costs: list[float]) -> int:
        lo, hi = min(costs), max(costs)
        span = hi - lo if hi > lo else 1.0
        weights = [math.exp(-(c - lo) / span / self.config.temperature) for c in costs]
        return self._rng.choices(range(len(costs)), weights=weights)[0]
