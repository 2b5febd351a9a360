"""Which ranks hold which KV units: the cache-aware policy's view of the cluster's caches.

Fed by two sources:

- **KV events** polled from each worker's ``GET /kv_events`` (``apply``, or ``apply_raw`` for
  the worker's JSON objects as they come): authoritative; a unit stays until a ``removed`` event
  or the worker leaves.
- **Own placements** (``add_predicted``): when the router sends a prompt to a rank it assumes
  the rank will hold the prompt's units soon, for ``predicted_ttl_s`` (the events, when they
  come, confirm them). This covers the gap before the first event and workers without events.

Layout: ``_holders[key] = {rank: expiry}`` (``inf`` for confirmed units) and ``_shared[key]`` for
units in a shared tier (Redis, shared FS) that every rank can load. Keys are the chained hashes
of ``kvstore.keys.chain_keys``, so a prompt's units are a chain and a match is the longest run
of leading keys. Both dicts keep insertion order and a stored or refreshed key moves to the end,
so trimming to ``max_keys`` drops the least recently stored units first (a prediction refreshes a
unit at most once per half TTL: moving keys costs more than the order is worth).

``match`` walks the prompt's keys once for all ranks (O(units x ranks holding them); one dict
lookup per unit once a single rank is left, the common case); the last
result is memoised by keys object and index version, so a policy asking once per candidate rank
pays for one walk. Single-threaded (the router's event loop); no locking.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from hashlib import blake2b
from typing import Any

from engine.protocol import KVEvent
from kvstore.keys import ROOT_KEY, chain_keys
from router.policies.base import PrefixMatch, RankKey

SHARED_TIERS = frozenset({"redis", "fs"})
_INF = math.inf


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
                    for k in ev["keys"]:
                        h = holders.pop(k, None)
                        if h is None:
                            h = {}
                        holders[k] = h
                        h[rank] = _INF
                else:
                    self._apply_one(rank, stored, ev.get("tier", "memory") in shared_tiers, ev["keys"])
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
            holders = self._holders
            for k in keys:
                h = holders.pop(k, None)
                if h is None:
                    h = {}
                holders[k] = h
                h[rank] = _INF
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
        changed = False
        for k in keys:
            h = self._holders.get(k)
            if h is not None and h.get(rank, 0.0) >= fresh:
                continue  # confirmed (inf) or recently predicted
            h = self._touch(k)
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

    def _touch(self, key: str) -> dict[RankKey, float]:
        h = self._holders.pop(key, None)
        if h is None:
            h = {}
        self._holders[key] = h
        return h

    def _changed(self) -> None:
        self._version += 1
        while len(self._holders) > self.max_keys:
            del self._holders[next(iter(self._holders))]
        while len(self._shared) > self.max_keys:
            del self._shared[next(iter(self._shared))]

    # ---- queries ---------------------------------------------------------------------------
    def match(self, keys: Sequence[str]) -> PrefixMatch:
        """Leading units of ``keys`` held per rank, and in shared tiers."""
        memo = self._memo
        if memo is not None and memo[0] is keys and memo[1] == self._version:
            return memo[2]
        holders = self._holders
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
        result = PrefixMatch(local=local, shared=shared)
        self._memo = (keys, self._version, result)
        return result

    def matched_blocks(self, rank: RankKey, keys: Sequence[str]) -> int:
        return self.match(keys).local.get(rank, 0)


class PromptHasher:
    """``kvstore.keys.chain_keys`` of prompts, fast: the router hashes every prompt it places.

    Same keys as the engine's (blake2b-128 of parent key, fingerprint, format and the unit's
    int64 token bytes, chained), computed with less Python per unit:

    - a memo maps ``(parent key, hash(tuple(unit tokens)))`` to the unit's key, so a prompt
      sharing a prefix with an earlier one (the next turn of a conversation, a common system
      prompt) pays a tuple hash per shared unit (~1 µs per 128 tokens) instead of a blake2b;
    - a unit missing from the memo is packed to int64 bytes with a precompiled ``struct``
      (0.8 µs per 128 tokens; ``array('q')`` of the prompt took 2 µs, ``numpy.asarray`` per
      unit more), with the fingerprint and format bytes encoded once.

    The 64-bit Python hash could collide: that would only misplace one request (the engine
    hashes on its own), never corrupt anything. The memo keeps ``max_entries`` units, oldest
    dropped first. ``reference`` is the contract (tests compare).
    """

    def __init__(self, block_size: int, fingerprint: str = "", max_entries: int = 200_000, fmt: str = "v1") -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self._fmt = fmt
        self._fingerprint = fingerprint
        self._suffix = (fingerprint + fmt).encode()
        self._pack = struct.Struct(f"={block_size}q").pack  # a unit's int64 bytes, native order
        self._memo: dict[tuple[str, int], str] = {}

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str) -> None:
        if value != self._fingerprint:
            self._fingerprint = value
            self._suffix = (value + self._fmt).encode()
            self._memo.clear()

    def keys(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        """The prompt's unit keys; ``ValueError`` for a token id outside int64."""
        bs = self.block_size
        n = len(token_ids) // bs
        if n == 0:
            return ()
        memo, pack, suffix = self._memo, self._pack, self._suffix
        parent, out = ROOT_KEY, []
        for start in range(0, n * bs, bs):
            unit = tuple(token_ids[start : start + bs])
            mk = (parent, hash(unit))
            key = memo.get(mk)
            if key is None:
                h = blake2b(parent.encode() + suffix, digest_size=16)
                try:
                    h.update(pack(*unit))
                except struct.error as exc:
                    raise ValueError(f"token ids must be int64: {exc}") from None
                key = memo[mk] = h.hexdigest()
                if len(memo) > self.max_entries:
                    del memo[next(iter(memo))]
            parent = key
            out.append(key)
        return tuple(out)

    @staticmethod
    def reference(token_ids: Sequence[int], block_size: int, fingerprint: str) -> list[str]:
        """The contract this class must equal (tests compare)."""
        return chain_keys(token_ids, block_size, fingerprint)
