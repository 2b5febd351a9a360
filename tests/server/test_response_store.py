"""The stored-Responses LRU: entry and byte bounds, TTL, and running background entries."""

from __future__ import annotations

import asyncio

import pytest

from server.config import GatewayConfig
from server.response_store import ResponseStore, ResponseStoreConfig, StoredResponse


class Clock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(rid: str, text: str = "x") -> StoredResponse:
    return StoredResponse(rid, "key", {"id": rid, "output": text}, [{"role": "user", "content": text}])


def test_least_recently_used_goes_first_at_the_entry_cap() -> None:
    store = ResponseStore(ResponseStoreConfig(max_entries=2))
    store.put(_entry("a"))
    store.put(_entry("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put(_entry("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def test_byte_cap_evicts_and_an_oversized_entry_is_not_kept() -> None:
    one = len('{"id": "a", "output": "' + "x" * 100 + '"}') + len('[{"role": "user", "content": "' + "x" * 100 + '"}]')
    store = ResponseStore(ResponseStoreConfig(max_bytes=2 * one))
    for rid in "abc":
        store.put(_entry(rid, "x" * 100))
    assert len(store) == 2 and store.bytes == 2 * one and store.get("a") is None
    store.put(_entry("huge", "x" * 10 * one))
    assert store.get("huge") is None and store.bytes <= 2 * one


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ResponseStoreConfig(ttl_s=10), clock)
    store.put(_entry("a"))
    clock.now = 9.0
    assert store.get("a") is not None
    clock.now = 10.5
    assert store.get("a") is None and len(store) == 0 and store.bytes == 0


def test_evicting_or_deleting_a_running_background_entry_cancels_it() -> None:
    async def main() -> None:
        store = ResponseStore(ResponseStoreConfig(max_entries=1))
        tasks = []
        for rid in ("a", "b"):
            entry = _entry(rid)
            entry.task = asyncio.ensure_future(asyncio.sleep(60))
            tasks.append(entry.task)
            store.put(entry)
        await asyncio.sleep(0)
        assert tasks[0].cancelled() and not tasks[1].done()
        assert store.delete("b") and not store.delete("b")
        await asyncio.sleep(0)
        assert tasks[1].cancelled()

    asyncio.run(main())


def test_bounds_come_from_the_gateway_config() -> None:
    cfg = GatewayConfig(responses_max_stored=3, responses_ttl_s=5.0)
    assert cfg.response_store() == ResponseStoreConfig(max_entries=3, ttl_s=5.0)
    with pytest.raises(ValueError):
        GatewayConfig(responses_max_stored=0)
