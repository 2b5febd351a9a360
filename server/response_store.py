"""Stored Responses (``store``, ``previous_response_id``, ``GET/DELETE /v1/responses/{id}``,
``background``): the store interface, its record, and the embedded bounded store.

A record (``StoredResponse``) keeps the response object as ``GET`` answers it and the conversation
it ends: the input items it was generated from (a ``previous_response_id`` chain already expanded)
followed by its output items, which is what a later ``previous_response_id`` continues. It is
plain JSON, so every store keeps the same thing: ``MemoryResponseStore`` here (one gateway), and
``server/response_store_redis.py`` (the Redis-protocol server, shared by every gateway that uses
it). A background run's task is not part of the record: it belongs to the gateway that runs it
(``server/response_flow.py``), which notices a cancel or delete made through another gateway.

The contract every store keeps (all methods are coroutines, on the gateway's event loop):
- ``get``: the record, or None when unknown or expired;
- ``put``: write the whole record at once (a reader sees the old record or the new one, never a
  part); its TTL (``ttl_s``) starts again. With ``if_running`` the write happens only while the
  stored record is still running (``queued`` / ``in_progress``): a cancel or delete made meanwhile
  wins over the run's later writes. A record larger than ``max_bytes`` is not kept;
- ``delete``: remove it; False when unknown;
- a store that cannot answer raises ``StoreUnavailable`` (503): never a silent miss.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from server.errors import GatewayError

RUNNING = ("queued", "in_progress")


class StoreUnavailable(GatewayError):
    status, type, code = 503, "server_error", "response_store_unavailable"


@dataclass(frozen=True)
class ResponseStoreConfig:
    """Bounds of the store (defaults: 1024 responses, 256 MiB of JSON, one hour). A shared store
    keeps ``max_bytes`` per record and leaves the count to the server's own memory policy."""

    max_entries: int = 1024
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0
    poll_s: float = 1.0  # how often a background run checks its record for a cancel or delete

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError("the response store needs max_entries >= 1 and max_bytes >= 1")
        if not self.ttl_s > 0 or not self.poll_s > 0:
            raise ValueError("the response store's ttl_s and poll_s must be > 0")


def owner_id(key: str) -> str:
    """What a record keeps of the API key (or client address) that created it: a digest, so no
    key is written to a shared store."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass
class StoredResponse:
    """One stored response; ``history``: the input items it answered, then its output items."""

    id: str
    owner: str  # ``owner_id`` of the creator; only it may read the record
    response: dict[str, Any]
    history: list[Any]
    inputs: int = 0  # how many of ``history``'s items were its input (GET .../input_items)

    @property
    def status(self) -> str:
        return str(self.response.get("status", ""))

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    def to_json(self) -> str:
        doc = {"id": self.id, "owner": self.owner, "response": self.response, "history": self.history, "inputs": self.inputs}
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        d = json.loads(text)
        return cls(d["id"], d["owner"], d["response"], d["history"], int(d.get("inputs", 0)))


class ResponseStore(Protocol):
    """Where stored Responses live; see the module docstring for the contract."""

    config: ResponseStoreConfig

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, entry: StoredResponse, *, if_running: bool = False) -> bool: ...

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """The embedded store: an LRU of record JSON with a TTL. At most ``max_entries`` records and
    ``max_bytes`` of JSON, the least recently used evicted first; a record expires ``ttl_s``
    after it was last written. One event loop, no awaits inside an operation: no locking."""

    def __init__(self, config: ResponseStoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (record JSON, expiry)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    async def get(self, response_id: str) -> StoredResponse | None:
        text = self._live(response_id)
        if text is None:
            return None
        self._entries.move_to_end(response_id)
        return StoredResponse.from_json(text)

    async def put(self, entry: StoredResponse, *, if_running: bool = False) -> bool:
        if if_running:
            current = self._live(entry.id)
            if current is None or not StoredResponse.from_json(current).running:
                return False
        self._drop(entry.id)
        text = entry.to_json()
        if len(text) > self.config.max_bytes:
            return False
        self._entries[entry.id] = (text, self._clock() + self.config.ttl_s)
        self._bytes += len(text)
        while len(self._entries) > self.config.max_entries or self._bytes > self.config.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    async def delete(self, response_id: str) -> bool:
        if self._live(response_id) is None:
            return False
        self._drop(response_id)
        return True

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _live(self, response_id: str) -> str | None:
        """The record's JSON unless unknown or expired (an expired one is dropped)."""
        item = self._entries.get(response_id)
        if item is None:
            return None
        if self._clock() > item[1]:
            self._drop(response_id)
            return None
        return item[0]

    def _drop(self, response_id: str) -> None:
        item = self._entries.pop(response_id, None)
        if item is not None:
            self._bytes -= len(item[0])
