"""Which ranks hold which KV units: the cache-aware policy's view of the cluster's caches.

Fed by two sources:

- **KV events** polled from each worker's ``GET /kv_events`` (``apply``, or ``apply_rows`` /
  ``apply_raw`` for the worker's JSON rows or objects as they come): authoritative; a unit stays until a ``removed`` event
  or the worker leaves.
- **Own placements** (``add_predicted``): when the router sends a prompt to a rank it assumes
  the rank will hold the prompt's units soon, for ``predicted_ttl_s`` (the events, when they
  come, confirm them). This covers the gap before the first event and workers without events.

Layout: ``_holders[key] = {rank: expiry}`` (``inf`` for confirmed units) and ``_shared[key]`` for
units in a shared tier (Redis, shared FS) that every rank can load. Keys are the chained hashes
of ``kvstore.keys.chain_keys``, so a prompt's units are a chain and a match is the longest run
of leading keys. Both dicts keep insertion order and a stored or refreshed key moves to the end,
so trimming to ``max_keys`` drops the least recently stored units first (a prediction refreshes a
unit at most once per half TTL: moving keys costs more than the order is worth). A dict over its
bound is trimmed in one go to ``max_keys - max_keys // 64`` (``trim_oldest``): dropping the
oldest key one at a time made every new key at the bound cost ~40 µs, because a dict's
iterator walks over the deleted slots at its front until the table is rebuilt.

``match`` walks the prompt's keys once for all ranks (O(units x ranks holding them); one dict
lookup per unit once a single rank is left, the common case); the last
result is memoised by keys object and index version, so a policy asking once per candidate rank
pays for one walk. Single-threaded (the router's event loop); no locking.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any

from deepserve.protocol import KV_REMOVED, KV_STORED, KVEvent
from router.policies.base import PrefixMatch, RankKey

SHARED_TIERS = frozenset({"redis", "fs"})
_INF = math.inf
_NO_MATCH = PrefixMatch({}, 0)  # shared by every miss: callers only read it


def trim_oldest(d: dict, keep: int) -> None:
    """Drop the oldest entries of ``d`` (insertion order) until ``keep`` are left, with one walk
    over its front (``del d[next(iter(d))]`` per entry walks the deleted slots every time)."""
    n = len(d) - keep
    if n > 0:
        for k in list(islice(d, n)):
            del d[k]


class KVIndex:
    def __init__(
        self,
        *,
        max_keys: int = 1_000_000,
        predicted_ttl_s: float = 120.0,
        shared_tiers: frozenset[str] = SHARED_TIERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_keys = max_keys
        self.predicted_ttl_s = predicted_ttl_s
        self.shared_tiers = shared_tiers
        self._clock = clock
        self._holders: dict[str, dict[RankKey, float]] = {}
        self._shared: dict[str, None] = {}
        self._version = 0
        self._memo: tuple[object, int, PrefixMatch] | None = None

    def __len__(self) -> int:
        return len(self._holders) + len(self._shared)

    # ---- updates ---------------------------------------------------------------------------
    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply KV events reported by one worker."""
        try:
            for ev in events:
                self._apply_one((worker_id, ev.dp_rank), ev.kind == "stored", ev.tier in self.shared_tiers, ev.keys)
        finally:
            self._changed()

    def apply_raw(self, worker_id: str, events: Iterable[dict[str, Any]]) -> None:
        """``apply`` for events as the worker's JSON objects (``KVEvent.to_dict`` layout):
        what the registry's poller feeds, without building a ``KVEvent`` per event. The common
        event (units stored in a rank's own tier) is applied inline: a poll can bring one per
        request placed since the last."""
        shared_tiers = self.shared_tiers
        holders = self._holders
        ranks: dict[Any, RankKey] = {}
        try:
            for ev in events:
                r = ev.get("dp_rank", 0)
                rank = ranks.get(r)
                if rank is None:
                    rank = ranks[r] = (worker_id, int(r))
                stored = ev["kind"] == "stored"
                if stored and ev.get("tier", "memory") not in shared_tiers:
                    _store(holders, rank, ev["keys"])
                else:
                    self._apply_one(rank, stored, ev.get("tier", "memory") in shared_tiers, ev["keys"])
        finally:
            self._changed()

    def apply_rows(self, worker_id: str, rows: Iterable[Sequence[Any]]) -> None:
        """``apply`` for events as ``KVEvent.to_row`` rows (``[op, dp_rank, tier, keys]``, what
        a worker answers to ``/kv_events?format=rows``): the same result as ``apply`` of the
        same events, without a ``KVEvent`` or a dict per event. An op other than stored (1) or
        removed (0) raises ``ValueError`` (the rows before it are applied)."""
        shared_tiers = self.shared_tiers
        holders = self._holders
        ranks: dict[Any, RankKey] = {}
        try:
            for op, r, tier, keys in rows:
                rank = ranks.get(r)
                if rank is None:
                    rank = ranks[r] = (worker_id, int(r))
                if op == KV_STORED and tier not in shared_tiers:
                    _store(holders, rank, keys)
                elif op == KV_STORED or op == KV_REMOVED:
                    self._apply_one(rank, op == KV_STORED, tier in shared_tiers, keys)
                else:
                    raise ValueError(f"KV event op must be {KV_STORED} or {KV_REMOVED}, not {op!r}")
        finally:
            self._changed()

    def _apply_one(self, rank: RankKey, stored: bool, shared: bool, keys: Iterable[str]) -> None:
        if shared:
            tier = self._shared
            for k in keys:
                tier.pop(k, None)
                if stored:
                    tier[k] = None
        elif stored:
            _store(self._holders, rank, keys)
        else:
            holders = self._holders
            for k in keys:
                h = holders.get(k)
                if h is not None:
                    h.pop(rank, None)
                    if not h:
                        del holders[k]

    def add_predicted(self, rank: RankKey, keys: Sequence[str]) -> None:
        """Assume ``rank`` holds ``keys`` (a prompt just placed there) for ``predicted_ttl_s``.

        A unit already held there with at least half its TTL left is left alone (no reordering,
        no version bump), so a hot prefix placed again and again costs a lookup per unit."""
        now = self._clock()
        expiry = now + self.predicted_ttl_s
        fresh = now + self.predicted_ttl_s / 2
        holders = self._holders
        changed = False
        for k in keys:
            h = holders.get(k)
            if h is None:  # a new unit (the common case for a new prompt)
                holders[k] = {rank: expiry}
            else:
                if h.get(rank, 0.0) >= fresh:
                    continue  # confirmed (inf) or recently predicted
                del holders[k]  # refreshed: to the end
                holders[k] = h
                if h.get(rank, 0.0) < expiry:
                    h[rank] = expiry
            changed = True
        if changed:
            self._changed()

    def remove_worker(self, worker_id: str) -> None:
        """Forget every unit of a worker (it left, or restarted and lost its cache)."""
        for k in list(self._holders):
            h = self._holders[k]
            for rank in [r for r in h if r[0] == worker_id]:
                del h[rank]
            if not h:
                del self._holders[k]
        self._changed()

    def _changed(self) -> None:
        self._version += 1
        if len(self._holders) > self.max_keys:
            trim_oldest(self._holders, self.max_keys - self.max_keys // 64)
        if len(self._shared) > self.max_keys:
            trim_oldest(self._shared, self.max_keys - self.max_keys // 64)

    # ---- queries ---------------------------------------------------------------------------
    def match(self, keys: Sequence[str]) -> PrefixMatch:
        """Leading units of ``keys`` held per rank, and in shared tiers."""
        memo = self._memo
        if memo is not None and memo[0] is keys and memo[1] == self._version:
            return memo[2]
        holders = self._holders
        if not keys or (keys[0] not in holders and keys[0] not in self._shared):
            return _NO_MATCH  # a new prompt (the common case under fresh traffic): two lookups
        local: dict[RankKey, int] = {}
        alive: list[RankKey] = []
        depth = 0
        now = 0.0
        for k in keys:
            h = holders.get(k)
            if not h:
                break
            if depth == 0:
                now = self._clock()
                alive = [r for r, exp in h.items() if exp > now]
                if len(alive) == 1:  # one holder (the common case): one lookup per unit
                    r = alive[0]
                    for k in keys:
                        h = holders.get(k)
                        if not h or h.get(r, 0.0) <= now:
                            break
                        depth += 1
                    alive = []
                    local[r] = depth
                    break
            else:
                still = [r for r in alive if h.get(r, 0.0) > now]
                if len(still) != len(alive):
                    for r in alive:
                        if r not in still:
                            local[r] = depth
                alive = still
            if not alive:
                break
            depth += 1
        for r in alive:
            local[r] = depth
        shared = 0
        if self._shared:
            for k in keys:
                if k not in self._shared:
                    break
                shared += 1
        result = PrefixMatch(local, shared)
        self._memo = (keys, self._version, result)
        return result


def _store(holders: dict[str, dict[RankKey, float]], rank: RankKey, keys: Iterable[str]) -> None:
    """``rank`` holds ``keys`` for good (a stored event): each unit moves to the newest end."""
    for k in keys:
        h = holders.pop(k, None)
        if h is None:
            h = {}
        holders[k] = h
        h[rank] = _INF
