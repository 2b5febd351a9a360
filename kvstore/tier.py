"""One tier: a backend plus its byte budget, eviction policy, metrics and events.

The tier is where mechanism meets policy: before a put it asks the policy for victims until the
value fits ``budget_bytes`` (pinned keys are skipped), and when the backend itself reports
``BackendFull`` (host pool at capacity, disk full) it evicts about one value's worth and retries
once. If there is still no room the put is dropped (a later read is a miss) and counted.

Latency histograms observe one backend call each (a batched call counts once).

Locking: eviction and policy updates run under the tier's lock; backend reads and writes do not,
so slow I/O never blocks other keys. Concurrent puts may overshoot the budget by the values in
flight at that moment.

Byte accounting: the budget is compared with ``backend.used_bytes()``; the tier remembers the size
of every key it tracks (its own puts, keys found at start-up, keys it read) to know what an
eviction frees. Shared backends (redis, fs) usually run without a budget: Redis' own maxmemory
policy or the filesystem's capacity bounds them, and other workers' keys are not tracked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvstore.backends.base import Backend
from kvstore.errors import BackendFull
from kvstore.events import KVEventLog
from kvstore.eviction import EvictionPolicy, LRUPolicy
from kvstore.metrics import KVStoreMetrics


class Tier:
    """A named, optionally budgeted backend. ``name`` is the metrics label and event tier."""

    def __init__(
        self,
        name: str,
        backend: Backend,
        *,
        budget_bytes: int | None = None,
        policy: EvictionPolicy | None = None,
        metrics: KVStoreMetrics | None = None,
        events: KVEventLog | None = None,
        track_existing: bool | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"tier {name}: budget_bytes must be > 0 or None")
        self.name = name
        self.backend = backend
        self.budget_bytes = budget_bytes
        self.policy = policy if policy is not None else LRUPolicy()
        self.metrics = metrics if metrics is not None else KVStoreMetrics()
        self.events = events
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._read_bps: float | None = None  # EWMA of bytes/s over reads that found data
        backend.on_error = self._on_error
        if track_existing if track_existing is not None else budget_bytes is not None:
            for key, size in backend.entries():  # e.g. an SSD directory from a previous run
                self._track(key, size)
        self._update_gauges()

    # --- bookkeeping -------------------------------------------------------------------------
    def _on_error(self, op: str, exc: BaseException) -> None:
        if op == "corrupt":
            self.metrics.corrupt.labels(self.name).inc()
        else:
            self.metrics.errors.labels(self.name, op).inc()

    def _track(self, key: str, size: int) -> None:
        self._sizes[key] = size
        self.policy.on_insert(key)

    def _untrack(self, key: str) -> None:
        self._sizes.pop(key, None)
        self.policy.on_remove(key)

    def _update_gauges(self) -> None:
        self.metrics.bytes_used.labels(self.name).set(self.backend.used_bytes())
        self.metrics.keys.labels(self.name).set(len(self.policy))

    def _publish(self, kind: str, keys: list[str], dp_rank: int | None = None) -> None:
        if self.events is not None and keys:
            self.events.publish(kind, keys, self.name, dp_rank)  # type: ignore[arg-type]

    def record_hit(self) -> None:
        self.metrics.hits.labels(self.name).inc()

    def record_miss(self, n: int = 1) -> None:
        if n:
            self.metrics.misses.labels(self.name).inc(n)

    def used_bytes(self) -> int:
        return self.backend.used_bytes()

    @property
    def read_bytes_per_s(self) -> float | None:
        """Recent read bandwidth (EWMA, None before the first hit): lets the engine compare the
        time to load a unit from this tier with the time to recompute it."""
        return self._read_bps

    # --- eviction ----------------------------------------------------------------------------
    def _evict(self, need: int, protect: str) -> tuple[bool, list[str]]:
        """Evict (under the lock) until ``need`` bytes are freed; returns (enough, evicted keys)."""
        evicted: list[str] = []
        for victim in self.policy.victims():
            if need <= 0:
                break
            if victim == protect or self.backend.is_pinned(victim):
                continue
            size = self._sizes.get(victim, 0)
            self.backend.remove(victim)
            self._untrack(victim)
            evicted.append(victim)
            need -= size
        if evicted:
            self.metrics.evictions.labels(self.name).inc(len(evicted))
        return need <= 0, evicted

    def _room_for(self, key: str, n: int) -> tuple[bool, list[str]]:
        if self.budget_bytes is None:
            return True, []
        if n > self.budget_bytes:
            return False, []
        return self._evict(self.backend.used_bytes() + n - self._sizes.get(key, 0) - self.budget_bytes, key)

    # --- interface ---------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.backend.contains_many(keys)

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Raw values (or ``None``); the caller decodes them and reports hits and misses."""
        t0 = time.perf_counter()
        blobs = self.backend.get_many(keys) if len(keys) > 1 else [self.backend.get(keys[0])] if keys else []
        dt = time.perf_counter() - t0
        self.metrics.get_seconds.labels(self.name).observe(dt)
        found = sum(len(b) for b in blobs if b is not None)
        if found and dt > 0:
            bps = found / dt
            self._read_bps = bps if self._read_bps is None else 0.8 * self._read_bps + 0.2 * bps
        with self._lock:
            for key, blob in zip(keys, blobs):
                if blob is None:
                    continue
                if key in self._sizes:
                    self.policy.on_access(key)
                else:
                    self._track(key, len(blob))  # written by another process
        return blobs

    def put(self, key: str, value: bytes, *, overwrite: bool = False) -> bool:
        """Store ``value`` (evicting for room); with ``overwrite=False`` an existing key is kept."""
        return self.put_many([(key, value)], overwrite=overwrite)[0]

    def put_many(
        self, items: Sequence[tuple[str, bytes]], *, overwrite: bool = False, dp_rank: int | None = None
    ) -> list[bool]:
        """``put`` of several items; their ``stored`` event names ``dp_rank`` (the writer's)."""
        if not overwrite and items:
            present = self.contains_many([k for k, _ in items])
            with self._lock:
                for (k, _), p in zip(items, present):
                    if p:
                        self.policy.on_access(k)
            todo = [it for it, p in zip(items, present) if not p]
            done = iter(self._put_new(todo, dp_rank))
            return [True if p else next(done) for p in present]
        return self._put_new(list(items), dp_rank)

    def _put_new(self, items: list[tuple[str, bytes]], dp_rank: int | None) -> list[bool]:
        results: list[bool] = []
        evicted: list[str] = []
        batched = False
        if self.budget_bytes is None and len(items) > 1:  # nothing to evict ahead: one batched call
            t0 = time.perf_counter()
            try:
                results = self.backend.put_many(items)
                batched = True
            except BackendFull:
                pass  # retry item by item, evicting as needed
            else:
                self.metrics.put_seconds.labels(self.name).observe(time.perf_counter() - t0)
                with self._lock:
                    for (key, value), ok in zip(items, results):
                        if ok:
                            self._track(key, len(value))
        if not batched:
            results = []
            for key, value in items:  # each needs its own room
                ok, ev = self._put_one(key, value)
                evicted += ev
                results.append(ok)
        self._update_gauges()
        self._publish("removed", evicted)
        self._publish("stored", [key for (key, _), ok in zip(items, results) if ok], dp_rank)
        return results

    def _put_one(self, key: str, value: bytes) -> tuple[bool, list[str]]:
        n = len(value)
        with self._lock:
            room, evicted = self._room_for(key, n)
        if not room:
            self.metrics.rejected.labels(self.name).inc()
            return False, evicted
        t0 = time.perf_counter()
        try:
            ok = self.backend.put(key, value)
        except BackendFull:
            with self._lock:
                _, more = self._evict(n, key)
            evicted += more
            try:
                ok = bool(more) and self.backend.put(key, value)
            except BackendFull:
                ok = False
            if not ok:
                self.metrics.rejected.labels(self.name).inc()
                return False, evicted
        self.metrics.put_seconds.labels(self.name).observe(time.perf_counter() - t0)
        if ok:
            with self._lock:
                self._track(key, n)
        return ok, evicted

    def remove(self, key: str) -> bool:
        """Delete ``key`` (pinned or not) and publish a ``removed`` event when it was there."""
        existed = self.backend.remove(key)
        with self._lock:
            self._untrack(key)
        self._update_gauges()
        if existed:
            self._publish("removed", [key])
        return existed

    def pin(self, key: str) -> None:
        self.backend.pin(key)

    def unpin(self, key: str) -> None:
        self.backend.unpin(key)

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, {type(self.backend).__name__}, budget={self.budget_bytes})"
