"""``TieredStore``: records over an ordered list of tiers, fastest first.

Reads walk the tiers in order and stop at the first copy that decodes (magic, length, crc32 and
the record's own key all check out). A damaged copy counts as a corrupt record and a miss, is
removed from its tier, and the walk goes on to slower tiers. A hit in tier ``i`` is copied into
tiers ``0..i-1`` (read-through promotion, ``promote``).

Writes encode the record once. ``write_mode="through"`` stores it in every tier before returning;
``"back"`` stores it in the first tier and hands it to one background thread that copies it into
the slower tiers in order (``flush()`` waits for that queue; a full queue makes ``put`` wait).
Content-addressed keys never change meaning, so a tier that already holds a key is not rewritten.

Nothing here raises because storage misbehaves: a tier that is down, slow, full or corrupt turns
into misses and metrics. ``longest_prefix`` answers from ``contains`` alone, so a unit it counts
may still turn out damaged or expired on ``get``: the engine must treat a failed load as a miss.

Thread safety: all methods may be called from several threads.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from kvstore.config import KVStoreConfig
from kvstore.errors import CorruptRecord
from kvstore.events import KVEventLog, Subscriber
from kvstore.eviction import make_policy
from kvstore.metrics import KVStoreMetrics
from kvstore.record import Record, RecordHeader, decode_record, encode_record
from kvstore.registry import make_backend
from kvstore.tier import Tier

log = logging.getLogger(__name__)

_STOP = object()


class TieredStore:
    """The KV cache store the engine and router use; build one with ``build_store``."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_mode: str = "through",
        promote: bool = True,
        events: KVEventLog | None = None,
        writeback_queue: int = 64,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        if write_mode not in ("through", "back"):
            raise ValueError(f"write_mode must be 'through' or 'back', got {write_mode!r}")
        self.tiers = list(tiers)
        self.write_mode = write_mode
        self.promote = promote
        self.events = events if events is not None else KVEventLog()
        for t in self.tiers:
            t.events = self.events
        self._queue: queue.Queue[object] = queue.Queue(maxsize=writeback_queue)
        self._writer: threading.Thread | None = None
        if write_mode == "back" and len(self.tiers) > 1:
            self._writer = threading.Thread(target=self._write_back_loop, name="kvstore-writeback", daemon=True)
            self._writer.start()

    # --- writes ------------------------------------------------------------------------------
    def put(self, key: str, header: RecordHeader, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Encode and store one record under ``key``; True when the first tier write succeeded
        (write-back) or any tier holds it (write-through)."""
        return self.put_many([(key, header, tensors)])[0]

    def put_many(
        self, items: Sequence[tuple[str, RecordHeader, Mapping[str, torch.Tensor]]], *, dp_rank: int | None = None
    ) -> list[bool]:
        """Store several records (e.g. all new units of one prompt) with batched tier writes;
        ``dp_rank``: the writing rank, named in the ``stored`` events."""
        blobs = [(k, encode_record(h if h.key else dataclasses.replace(h, key=k), t)) for k, h, t in items]
        return self.put_bytes_many(blobs, dp_rank=dp_rank)

    def put_bytes_many(self, items: Sequence[tuple[str, bytes]], *, dp_rank: int | None = None) -> list[bool]:
        """Store already-encoded records (``encode_record`` output)."""
        if not items:
            return []
        if self._writer is not None:
            ok = self.tiers[0].put_many(items, dp_rank=dp_rank)
            self._queue.put((list(items), dp_rank))
            return ok
        ok = [False] * len(items)
        for tier in self.tiers:
            ok = [a or b for a, b in zip(ok, tier.put_many(items, dp_rank=dp_rank))]
        return ok

    def _write_back_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                items, dp_rank = job  # type: ignore[misc]
                for tier in self.tiers[1:]:
                    tier.put_many(items, dp_rank=dp_rank)
            except Exception:  # never let the writer die: later puts would block forever
                log.exception("kvstore write-back failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every write-back record has reached all tiers."""
        if self._writer is not None:
            self._queue.join()

    # --- reads -------------------------------------------------------------------------------
    def get(self, key: str, *, copy: bool = True) -> Record | None:
        """The record stored under ``key`` from the fastest tier holding a valid copy, or None."""
        return self.get_many([key], copy=copy)[0]

    def get_many(self, keys: Sequence[str], *, copy: bool = True, dp_rank: int | None = None) -> list[Record | None]:
        """Records for ``keys`` (None where missing), one batched read per tier; a hit copied
        into faster tiers is announced as stored for ``dp_rank`` (the reader)."""
        out: list[Record | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            blobs = tier.get_many([keys[i] for i in todo])
            missed: list[int] = []
            promote: list[tuple[str, bytes]] = []
            for i, blob in zip(todo, blobs):
                rec = self._decode(tier, keys[i], blob, copy) if blob is not None else None
                if rec is None:
                    missed.append(i)
                    continue
                tier.record_hit()
                out[i] = rec
                promote.append((keys[i], bytes(blob)))  # type: ignore[arg-type]
            tier.record_miss(len(missed))
            if self.promote and promote:
                for faster in self.tiers[:ti]:
                    faster.put_many(promote, overwrite=True, dp_rank=dp_rank)
            todo = missed
        return out

    def _decode(self, tier: Tier, key: str, blob: bytes, copy: bool) -> Record | None:
        try:
            rec = decode_record(blob, copy=copy)
            if rec.header.key and rec.header.key != key:
                raise CorruptRecord(f"record for {rec.header.key} stored under {key}")
            return rec
        except CorruptRecord as exc:
            log.warning("kvstore tier %s: corrupt record %s (%s); dropped", tier.name, key, exc)
            tier.metrics.corrupt.labels(tier.name).inc()
            tier.remove(key)
            return None

    def contains(self, key: str) -> bool:
        return self.longest_prefix([key]) == 1

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` some tier holds (one batched ``contains`` per tier)."""
        n = len(keys)
        present = [False] * n
        p = 0
        for tier in self.tiers:
            idx = [i for i in range(p, n) if not present[i]]
            if not idx:
                break
            for i, ok in zip(idx, tier.contains_many([keys[i] for i in idx])):
                present[i] = ok
            while p < n and present[p]:
                p += 1
            if p == n:
                break
        return p

    # --- removal and pins ----------------------------------------------------------------------
    def remove(self, key: str) -> bool:
        """Delete ``key`` from every tier; True when any tier had it."""
        return any([t.remove(key) for t in self.tiers])

    def pin(self, keys: Sequence[str]) -> None:
        """Keep ``keys`` from eviction in every tier (e.g. while a request loads them)."""
        for t in self.tiers:
            for k in keys:
                t.pin(k)

    def unpin(self, keys: Sequence[str]) -> None:
        for t in self.tiers:
            for k in keys:
                t.unpin(k)

    # --- events and stats ----------------------------------------------------------------------
    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(seq, KVEvent)`` on every stored/removed event; returns an unsubscriber."""
        return self.events.subscribe(callback)

    def used_bytes(self) -> dict[str, int]:
        return {t.name: t.used_bytes() for t in self.tiers}

    def close(self) -> None:
        """Finish write-back, stop its thread and close every backend."""
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join()
            self._writer = None
        for t in self.tiers:
            t.backend.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_store(
    config: KVStoreConfig | None = None, *, metrics: KVStoreMetrics | None = None, registry: object | None = None
) -> TieredStore:
    """A ``TieredStore`` from ``config`` (default: ``KVStoreConfig.from_env()``).

    ``metrics`` or ``registry`` (a prometheus ``CollectorRegistry``) select where metrics go.
    """
    cfg = config if config is not None else KVStoreConfig.from_env()
    m = metrics if metrics is not None else KVStoreMetrics(registry)  # type: ignore[arg-type]
    events = KVEventLog(cfg.event_ring, dp_rank=cfg.dp_rank)
    tiers = [
        Tier(
            name,
            make_backend(name, cfg),
            budget_bytes=cfg.budget_for(name),
            policy=make_policy(cfg.eviction),
            metrics=m,
            events=events,
        )
        for name in cfg.tiers
    ]
    return TieredStore(
        tiers, write_mode=cfg.write_mode, promote=cfg.promote, events=events, writeback_queue=cfg.writeback_queue
    )
