"""KV events: which unit keys entered or left which tier at which DP rank, for cache-aware routing.

Every event gets a sequence number (1, 2, ...). Subscribers (callbacks) hear each event as it
happens; a bounded ring keeps the last ``capacity`` events so a worker can answer
``GET /kv_events?since=N`` (deepserve/protocol/messages.py) with the events after ``N``. A poller that falls
further behind than the ring gets ``complete=False`` and rebuilds its view of the worker from
``snapshot()`` (``GET /kv_events?snapshot=1``): the units held now, as ``stored`` events.

One store serves every DP rank of a worker, so an event names the rank it happened for: a
``stored`` event the rank whose write (or read, for a promotion into a faster tier) put the unit
there, passed down as ``dp_rank``. A unit that leaves a tier leaves every rank it was announced
for: one ``removed`` event per such rank. The log keeps, per
tier, a bit mask of those ranks for every unit it announced (one dict entry per unit).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

from deepserve.protocol import KVEvent

log = logging.getLogger(__name__)

Subscriber = Callable[[int, KVEvent], None]  # (sequence number, event)


class EventBatch(NamedTuple):
    """Events after a sequence number. ``seq``: the newest sequence number; ``complete``: False
    when events between the asked-for number and the oldest retained one were dropped."""

    seq: int
    events: list[KVEvent]
    complete: bool


class KVEventLog:
    """Bounded, thread-safe event ring, the units each rank holds per tier, a subscriber list.

    ``dp_rank``: the rank of a ``stored`` event published without one (a one-rank process)."""

    def __init__(self, capacity: int = 4096, dp_rank: int = 0) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.dp_rank = dp_rank
        self._ring: deque[tuple[int, KVEvent]] = deque(maxlen=capacity)
        self._seq = 0
        self._held: defaultdict[str, dict[str, int]] = defaultdict(dict)  # tier -> key -> rank mask
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    @property
    def seq(self) -> int:
        return self._seq

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` for every future event; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def publish(
        self, kind: Literal["stored", "removed"], keys: Sequence[str], tier: str, dp_rank: int | None = None
    ) -> int:
        """Record ``keys`` entering ``tier`` for ``dp_rank`` (``stored``), or leaving it
        (``removed``: one event per rank they were announced for). No-op for an empty key list;
        returns the last sequence number."""
        if not keys:
            return self._seq
        with self._lock:
            if kind == "stored":
                events = [self._stored(tier, keys, self.dp_rank if dp_rank is None else dp_rank)]
            else:
                events = self._removed(tier, keys)
            published = []
            for event in events:
                self._seq += 1
                self._ring.append((self._seq, event))
                published.append((self._seq, event))
            last = self._seq
            subscribers = list(self._subscribers)
        for seq, event in published:
            for cb in subscribers:
                try:
                    cb(seq, event)
                except Exception:
                    log.exception("kv event subscriber failed")
        return last

    def _stored(self, tier: str, keys: Sequence[str], rank: int) -> KVEvent:
        """The ``stored`` event, with ``rank``'s bit set on every key (under the lock)."""
        held, bit = self._held[tier], 1 << rank
        for k in keys:
            held[k] = held.get(k, 0) | bit
        return KVEvent(kind="stored", keys=list(keys), tier=tier, dp_rank=rank)

    def _removed(self, tier: str, keys: Sequence[str]) -> list[KVEvent]:
        """``removed`` events, one per rank that held some of ``keys`` (under the lock). Keys
        never announced are removed for the default rank (a tier filled by an earlier run)."""
        held = self._held[tier]
        by_rank: dict[int, list[str]] = {}
        for k in keys:
            for r in _ranks(held.pop(k, 0)) or [self.dp_rank]:
                by_rank.setdefault(r, []).append(k)
        return [KVEvent(kind="removed", keys=ks, tier=tier, dp_rank=r) for r, ks in sorted(by_rank.items())]

    def since(self, seq: int) -> EventBatch:
        """Retained events with sequence number > ``seq``."""
        with self._lock:
            events = [e for s, e in self._ring if s > seq]
            oldest = self._ring[0][0] if self._ring else self._seq + 1
            return EventBatch(self._seq, events, complete=seq >= oldest - 1)

    def snapshot(self) -> EventBatch:
        """The units held now, one ``stored`` event per (tier, rank), as of sequence number
        ``seq``: a poller that applies them to an emptied view and then asks ``since(seq)``
        has every event."""
        with self._lock:
            events: list[KVEvent] = []
            for tier, held in self._held.items():
                by_rank: dict[int, list[str]] = {}
                for k, mask in held.items():
                    for r in _ranks(mask):
                        by_rank.setdefault(r, []).append(k)
                events += [KVEvent(kind="stored", keys=ks, tier=tier, dp_rank=r) for r, ks in sorted(by_rank.items())]
            return EventBatch(self._seq, events, complete=True)


def _ranks(mask: int) -> list[int]:
    """The ranks whose bits are set in ``mask``, lowest first."""
    return [r for r in range(mask.bit_length()) if mask >> r & 1]
