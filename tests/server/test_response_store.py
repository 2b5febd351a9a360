"""The stored-Responses stores: one contract run against the embedded LRU and a real valkey server
(get / put / delete, conditional writes, TTL, one-record writes), plus the LRU's own bounds."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
import redis

from kvstore.config import KVStoreConfig
from server.config import GatewayConfig
from server.response_store import MemoryResponseStore, ResponseStoreConfig, StoredResponse, StoreUnavailable, owner_id
from server.response_store_redis import RedisResponseStore, open_response_store


class Clock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(rid: str, text: str = "x", status: str = "completed") -> StoredResponse:
    return StoredResponse(rid, owner_id("key"), {"id": rid, "status": status, "output": text}, [{"role": "user", "content": text}], 1)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _redis_store(url: str, config: ResponseStoreConfig = ResponseStoreConfig()) -> RedisResponseStore:
    kv = KVStoreConfig(tiers=("redis",), redis_url=url)
    store = open_response_store("auto", config, kv, f"test-responses-{uuid.uuid4().hex[:8]}")
    assert isinstance(store, RedisResponseStore)
    return store


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def make_store(request: pytest.FixtureRequest) -> Any:
    """``make_store(config)`` -> a fresh store of the parametrized kind (redis: its own prefix)."""

    def make(config: ResponseStoreConfig = ResponseStoreConfig()) -> Any:
        if request.param == "memory":
            return MemoryResponseStore(config)
        return _redis_store(request.getfixturevalue("redis_server").url, config)

    return make


# ---- the contract ---------------------------------------------------------------------------------
def test_put_get_delete_round_trip(make_store: Any) -> None:
    async def main() -> None:
        store = make_store()
        entry = _entry("resp_a", "héllo")
        assert await store.get("resp_a") is None
        assert await store.put(entry)
        got = await store.get("resp_a")
        assert got == entry and got is not entry  # a copy: a caller's later edits do not leak in
        assert await store.delete("resp_a") and not await store.delete("resp_a")
        assert await store.get("resp_a") is None
        await store.close()

    _run(main())


def test_conditional_write_never_undoes_a_cancel_or_delete(make_store: Any) -> None:
    async def main() -> None:
        store = make_store()
        running = _entry("resp_b", status="in_progress")
        assert not await store.put(running, if_running=True)  # nothing stored yet
        assert await store.put(running)
        done = _entry("resp_b", "answer", status="completed")
        assert await store.put(done, if_running=True)  # over a running record: written
        assert (await store.get("resp_b")).status == "completed"
        assert not await store.put(_entry("resp_b", status="in_progress"), if_running=True)  # over a finished one: not
        await store.put(_entry("resp_b", status="cancelled"))
        assert not await store.put(done, if_running=True) and (await store.get("resp_b")).status == "cancelled"
        await store.delete("resp_b")
        assert not await store.put(done, if_running=True) and await store.get("resp_b") is None
        await store.close()

    _run(main())


def test_an_oversized_record_is_not_kept(make_store: Any) -> None:
    async def main() -> None:
        store = make_store(ResponseStoreConfig(max_bytes=400))
        assert await store.put(_entry("resp_c", "small"))
        assert not await store.put(_entry("resp_c", "x" * 1000))
        assert await store.get("resp_c") is None
        await store.close()

    _run(main())


# ---- the Redis store ------------------------------------------------------------------------------
@pytest.mark.redis
def test_redis_record_is_one_key_with_the_ttl_and_expires(redis_server: Any) -> None:
    async def main() -> None:
        store = _redis_store(redis_server.url, ResponseStoreConfig(ttl_s=0.6))
        await store.put(_entry("resp_d"))
        raw = redis.Redis.from_url(redis_server.url)
        keys = raw.keys(store.prefix + ":*")
        assert keys == [store.key("resp_d").encode()]  # one string per record: no half-written parts
        assert 0 < raw.pttl(keys[0]) <= 600 and json.loads(raw.get(keys[0]))["owner"] == owner_id("key")
        await asyncio.sleep(0.8)
        assert await store.get("resp_d") is None  # the server expired it
        await store.close()

    _run(main())


@pytest.mark.redis
def test_redis_conditional_write_retries_over_a_concurrent_writer(redis_server: Any) -> None:
    """Two stores (two gateways) race on one record: each conditional write sees the other's."""

    async def main() -> None:
        a = _redis_store(redis_server.url)
        b = RedisResponseStore(a.config, redis.asyncio.Redis.from_url(redis_server.url), a.prefix)
        await a.put(_entry("resp_e", status="in_progress"))
        results = await asyncio.gather(
            a.put(_entry("resp_e", "from a", status="completed"), if_running=True),
            b.put(_entry("resp_e", status="cancelled"), if_running=True),
        )
        assert sorted(results) == [False, True]  # exactly one wins; the other sees a finished record
        assert (await b.get("resp_e")).status in ("completed", "cancelled")
        await a.close()
        await b.close()

    _run(main())


def test_redis_down_is_503_not_a_miss() -> None:
    async def main() -> None:
        store = _redis_store("redis://127.0.0.1:9/0")  # the discard port: nothing listens
        with pytest.raises(StoreUnavailable) as err:
            await store.get("resp_f")
        assert err.value.status == 503 and err.value.code == "response_store_unavailable"
        await store.close()

    _run(main())


def test_store_choice_follows_the_kv_tiers() -> None:
    cfg = ResponseStoreConfig()
    assert isinstance(open_response_store("auto", cfg, KVStoreConfig(tiers=("memory",)), "p"), MemoryResponseStore)
    assert isinstance(open_response_store("memory", cfg, KVStoreConfig(tiers=("memory", "redis")), "p"), MemoryResponseStore)
    store = open_response_store("redis", cfg, KVStoreConfig(tiers=("memory",), redis_url="redis://h:1/2"), "p")
    assert isinstance(store, RedisResponseStore) and store.key("r") == "p:r"
    with pytest.raises(ValueError):
        GatewayConfig(responses_store="sqlite")


# ---- the embedded LRU's bounds --------------------------------------------------------------------
def test_least_recently_used_goes_first_at_the_entry_cap() -> None:
    async def main() -> None:
        store = MemoryResponseStore(ResponseStoreConfig(max_entries=2))
        await store.put(_entry("a"))
        await store.put(_entry("b"))
        assert await store.get("a") is not None  # a is now the most recent
        await store.put(_entry("c"))
        assert await store.get("b") is None and await store.get("a") is not None and await store.get("c") is not None

    _run(main())


def test_byte_cap_evicts() -> None:
    async def main() -> None:
        one = len(_entry("a", "x" * 100).to_json())
        store = MemoryResponseStore(ResponseStoreConfig(max_bytes=2 * one))
        for rid in "abc":
            await store.put(_entry(rid, "x" * 100))
        assert len(store) == 2 and store.bytes == 2 * one and await store.get("a") is None

    _run(main())


def test_entries_expire_after_the_ttl() -> None:
    async def main() -> None:
        clock = Clock()
        store = MemoryResponseStore(ResponseStoreConfig(ttl_s=10), clock)
        await store.put(_entry("a"))
        clock.now = 9.0
        assert await store.get("a") is not None
        clock.now = 10.5
        assert await store.get("a") is None and len(store) == 0 and store.bytes == 0

    _run(main())


def test_bounds_come_from_the_gateway_config() -> None:
    cfg = GatewayConfig(responses_max_stored=3, responses_ttl_s=5.0)
    assert cfg.response_store() == ResponseStoreConfig(max_entries=3, ttl_s=5.0)
    with pytest.raises(ValueError):
        GatewayConfig(responses_max_stored=0)
