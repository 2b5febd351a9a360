"""Stored Responses (``store``, ``previous_response_id``, ``GET/DELETE /v1/responses/{id}``,
``background``): a bounded in-memory store on the gateway.

An entry keeps the response object as ``GET`` answers it and the conversation it ends: the input
items it was generated from (a ``previous_response_id`` chain already expanded) followed by its
output items, which is what a later ``previous_response_id`` continues. A background response also
keeps the task that produces it (``cancel`` cancels that task).

Bounds: at most ``max_entries`` entries and ``max_bytes`` of their JSON, the least recently used
evicted first; an entry expires ``ttl_s`` after it was last written. Evicting or deleting a running
background entry cancels its task. The store lives on one event loop (``Gateway.responses``) and
is only touched from it: no locking.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ResponseStoreConfig:
    """Bounds of the store (defaults: 1024 responses, 256 MiB of JSON, one hour)."""

    max_entries: int = 1024
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError("the response store needs max_entries >= 1 and max_bytes >= 1")
        if not self.ttl_s > 0:
            raise ValueError("the response store's ttl_s must be > 0")


@dataclass
class StoredResponse:
    """One stored response; ``history``: the input items it answered, then its output items."""

    id: str
    owner: str  # the API key (or client address) that created it; only it may read it
    response: dict[str, Any]
    history: list[Any]
    inputs: int = 0  # how many of ``history``'s items were its input (GET .../input_items)
    task: asyncio.Task[Any] | None = None  # the background run producing it (None: synchronous)
    size: int = 0  # bytes of JSON counted against ``max_bytes``
    expires: float = field(default=0.0)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ResponseStore:
    """LRU + TTL map of response id -> ``StoredResponse``; see the module docstring."""

    def __init__(self, config: ResponseStoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> None:
        """Insert or replace ``entry`` (most recently used), then evict down to the bounds; an
        entry larger than ``max_bytes`` on its own is not kept."""
        self._drop(entry.id, cancel=False)
        entry.size = len(json.dumps(entry.response, ensure_ascii=False)) + len(json.dumps(entry.history, ensure_ascii=False))
        entry.expires = self._clock() + self.config.ttl_s
        self._entries[entry.id] = entry
        self._bytes += entry.size
        while self._entries and (len(self._entries) > self.config.max_entries or self._bytes > self.config.max_bytes):
            self._drop(next(iter(self._entries)), cancel=True)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now most recently used), or None when unknown or expired."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._clock() > entry.expires and not entry.running:
            self._drop(response_id, cancel=False)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Remove an entry (cancelling its background run); False when unknown."""
        if self.get(response_id) is None:
            return False
        self._drop(response_id, cancel=True)
        return True

    def _drop(self, response_id: str, *, cancel: bool) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self._bytes -= entry.size
        if cancel and entry.running:
            assert entry.task is not None
            entry.task.cancel()
