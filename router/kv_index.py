"""Which ranks hold which KV units: the cache-aware policy's view of the cluster's caches.

Fed by two sources:

- **KV events** polled from each worker's ``GET /kv_events`` (``apply``): authoritative; a unit
  stays until a ``removed`` event or the worker leaves.
- **Own placements** (``add_predicted``): when the router sends a prompt to a rank it assumes
  the rank will hold the prompt's units soon, for ``predicted_ttl_s`` (the events, when they
  come, confirm them). This covers the gap before the first event and workers without events.

Layout: ``_holders[key] = {rank: expiry}`` (``inf`` for confirmed units) and ``_shared[key]`` for
units in a shared tier (Redis, shared FS) that every rank can load. Keys are the chained hashes
of ``kvstore.keys.chain_keys``, so a prompt's units are a chain and a match is the longest run
of leading keys. Both dicts keep insertion order and a stored or refreshed key moves to the end,
so trimming to ``max_keys`` drops the least recently stored units first (a prediction refreshes a
unit at most once per half TTL: moving keys costs more than the order is worth).

``match`` walks the prompt's keys once for all ranks (O(units x ranks holding them)); the last
result is memoised by keys object and index version, so a policy asking once per candidate rank
pays for one walk. Single-threaded (the router's event loop); no locking.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from engine.protocol import KVEvent
from kvstore.keys import ROOT_KEY, chain_keys, unit_key
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
        for ev in events:
            rank = (worker_id, ev.dp_rank)
            shared = ev.tier in self.shared_tiers
            if ev.kind == "stored":
                for k in ev.keys:
                    if shared:
                        self._shared.pop(k, None)
                        self._shared[k] = None
                    else:
                        self._touch(k)[rank] = _INF
            else:
                for k in ev.keys:
                    if shared:
                        self._shared.pop(k, None)
                    else:
                        h = self._holders.get(k)
                        if h is not None:
                            h.pop(rank, None)
                            if not h:
                                del self._holders[k]
        self._changed()

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
        now = self._clock()
        local: dict[RankKey, int] = {}
        alive: set[RankKey] | None = None
        for depth, k in enumerate(keys, 1):
            h = self._holders.get(k)
            if not h:
                break
            if alive is None:
                alive = {r for r, exp in h.items() if exp > now}
            else:
                alive = {r for r in alive if h.get(r, 0.0) > now}
            if not alive:
                break
            for r in alive:
                local[r] = depth
        shared = 0
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
    """``kvstore.keys.chain_keys`` of prompts, with a memo of unit keys.

    A unit's key depends on its parent's key and its own tokens, so the memo maps
    ``(parent key, hash(tuple(unit tokens)))`` to ``unit_key(...)``: a prompt sharing a prefix with
    an earlier one (the next turn of a conversation, a common system prompt) pays a tuple hash per
    shared unit instead of a blake2b over its bytes; only new units call ``unit_key``. The 64-bit
    Python hash could collide: that would only misplace one request (the engine hashes on its own),
    never corrupt anything. The memo keeps ``max_entries`` units, oldest dropped first.
    """

    def __init__(self, block_size: int, fingerprint: str = "", max_entries: int = 200_000) -> None:
        self.block_size = block_size
        self._fingerprint = fingerprint
        self.max_entries = max_entries
        self._memo: dict[tuple[str, int], str] = {}

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str) -> None:
        if value != self._fingerprint:
            self._fingerprint = value
            self._memo.clear()

    def keys(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        bs, memo, fp = self.block_size, self._memo, self._fingerprint
        parent, out = ROOT_KEY, []
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = token_ids[start : start + bs]
            mk = (parent, hash(tuple(block)))
            key = memo.get(mk)
            if key is None:
                key = memo[mk] = unit_key(parent, block, fp)
                if len(memo) > self.max_entries:
                    del memo[next(iter(memo))]
            parent = key
            out.append(key)
        return tuple(out)

    @staticmethod
    def reference(token_ids: Sequence[int], block_size: int, fingerprint: str) -> list[str]:
        """The contract this class must equal (tests compare)."""
        return chain_keys(token_ids, block_size, fingerprint)
