"""KV events: which unit keys entered or left which tier, for cache-aware routing.

Every event gets a sequence number (1, 2, ...). Subscribers (callbacks) hear each event as it
happens; a bounded ring keeps the last ``capacity`` events so a worker can answer
``GET /kv_events?since=N`` (engine/protocol.py) with the events after ``N``. A poller that falls
further behind than the ring gets ``complete=False`` and should rebuild its view of the worker.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

from engine.protocol import KVEvent

log = logging.getLogger(__name__)

Subscriber = Callable[[int, KVEvent], None]  # (sequence number, event)


class EventBatch(NamedTuple):
    """Events after a sequence number. ``seq``: the newest sequence number; ``complete``: False
    when events between the asked-for number and the oldest retained one were dropped."""

    seq: int
    events: list[KVEvent]
    complete: bool


class KVEventLog:
    """Bounded, thread-safe event ring plus a subscriber list."""

    def __init__(self, capacity: int = 4096, dp_rank: int = 0) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.dp_rank = dp_rank
        self._ring: deque[tuple[int, KVEvent]] = deque(maxlen=capacity)
        self._seq = 0
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

    def publish(self, kind: Literal["stored", "removed"], keys: Sequence[str], tier: str) -> int:
        """Record one event (no-op for an empty key list); returns its sequence number."""
        if not keys:
            return self._seq
        event = KVEvent(kind=kind, keys=list(keys), tier=tier, dp_rank=self.dp_rank)
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._ring.append((seq, event))
            subscribers = list(self._subscribers)
        for cb in subscribers:
            try:
                cb(seq, event)
            except Exception:
                log.exception("kv event subscriber failed")
        return seq

    def since(self, seq: int) -> EventBatch:
        """Retained events with sequence number > ``seq``."""
        with self._lock:
            events = [e for s, e in self._ring if s > seq]
            oldest = self._ring[0][0] if self._ring else self._seq + 1
            return EventBatch(self._seq, events, complete=seq >= oldest - 1)
