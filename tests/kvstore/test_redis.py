"""Redis tier against a real server: layout, TTL, pins, and faults (killed, restarted, slow)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from kvstore import KVStoreConfig, RecordHeader, build_store
from kvstore.backends import RedisBackend
from bench.localredis import LocalRedisServer
from kvstore.metrics import KVStoreMetrics
from kvstore.tier import Tier
from tests.kvstore.conftest import make_tensors, sample

pytestmark = pytest.mark.redis

KEY = "ab" * 16


def raw_client(server: LocalRedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def test_chunked_layout_and_ttl(redis_server: LocalRedisServer, prefix: str) -> None:
    b = RedisBackend(redis_server.url, prefix=prefix, chunk_size=1000, ttl_s=120)
    value = bytes(range(256)) * 10  # 2560 bytes -> 3 chunks
    b.put(KEY, value)
    r = raw_client(redis_server)
    names = sorted(n.decode() for n in r.keys(f"{prefix}:*"))
    assert names[-1] == f"{prefix}:m:{KEY}" and len(names) == 4
    assert all(n.startswith(f"{prefix}:c:{KEY}:") for n in names[:3])
    assert all(0 < r.ttl(n) <= 120 for n in names)
    b.put(KEY, b"small")  # back to inline: the old chunks and manifest are deleted
    assert [n.decode() for n in r.keys(f"{prefix}:*")] == [f"{prefix}:v:{KEY}"]


def test_missing_chunk_is_a_miss(redis_server: LocalRedisServer, prefix: str) -> None:
    b = RedisBackend(redis_server.url, prefix=prefix, chunk_size=1000)
    b.put(KEY, b"z" * 2500)
    r = raw_client(redis_server)
    r.delete(next(iter(r.keys(f"{prefix}:c:*"))))  # one chunk expired or was evicted by Redis
    assert b.get(KEY) is None


def test_pin_lifts_ttl_and_unpin_restores_it(redis_server: LocalRedisServer, prefix: str) -> None:
    b = RedisBackend(redis_server.url, prefix=prefix, chunk_size=1000, ttl_s=60)
    b.put(KEY, b"q" * 2500)
    r = raw_client(redis_server)
    b.pin(KEY)
    assert all(r.ttl(n) == -1 for n in r.keys(f"{prefix}:*"))
    b.unpin(KEY)
    assert all(0 < r.ttl(n) <= 60 for n in r.keys(f"{prefix}:*"))


def test_killed_server_gives_misses_then_recovers(
    redis_server: LocalRedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    cfg = KVStoreConfig(
        tiers=("memory", "redis"),
        redis_url=redis_server.url,
        redis_prefix=prefix,
        redis_retry_after_s=0.2,
        redis_timeout_s=0.5,
        chunk_bytes=4096,
    )
    store = build_store(cfg, registry=registry)
    h = RecordHeader("block", "fp", "bfloat16", 0, 128)
    keys = [f"{i:032x}" for i in range(4)]
    for key in keys:
        assert store.put(key, h, make_tensors(rows=32))
    for key in keys:
        store.tiers[0].remove(key)  # force reads to go to Redis
    assert store.get(keys[0]) is not None
    try:
        redis_server.kill()  # mid-use
        caplog.set_level(logging.WARNING, logger="kvstore.backends.redis")
        t0 = time.monotonic()
        assert store.get(keys[1]) is None
        assert store.get_many(keys[2:]) == [None, None]
        assert store.longest_prefix(keys) == 1  # keys[0] was promoted to memory
        assert store.put("f" * 32, h, make_tensors())  # memory still takes it
        store.remove(keys[0])
        assert time.monotonic() - t0 < 2.0
        assert sample(registry, "deepserve_kvstore_errors_total", tier="redis", op="get") >= 1
        outage_logs = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(outage_logs) == 1
    finally:
        redis_server.restart()
    time.sleep(0.25)  # let the breaker close
    assert store.get(keys[1]) is None  # the restarted server lost its data: a miss, not an error
    assert store.put(keys[1], h, make_tensors(rows=32))  # re-put
    store.tiers[0].remove(keys[1])
    assert store.get(keys[1]) is not None
    assert sample(registry, "deepserve_kvstore_hits_total", tier="redis") == 2
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_breaker_makes_a_dead_server_cheap(
    redis_server: LocalRedisServer, prefix: str, metrics: KVStoreMetrics, registry: CollectorRegistry
) -> None:
    b = RedisBackend(redis_server.url, prefix=prefix, retry_after_s=30)
    tier = Tier("redis", b, metrics=metrics)
    tier.put(KEY, b"v")
    try:
        redis_server.kill()
        assert tier.get(KEY) is None and not b.available
        t0 = time.monotonic()
        for _ in range(1000):
            assert tier.get(KEY) is None
            assert tier.put(KEY, b"w", overwrite=True) is False
        assert time.monotonic() - t0 < 0.5  # no network while the breaker is open
        assert sample(registry, "deepserve_kvstore_errors_total", tier="redis", op="get") == 1
    finally:
        redis_server.restart()


def test_slow_server_times_out_into_misses(
    redis_server: LocalRedisServer, prefix: str, metrics: KVStoreMetrics, registry: CollectorRegistry
) -> None:
    b = RedisBackend(redis_server.url, prefix=prefix, timeout_s=0.1, retry_after_s=0.05)
    tier = Tier("redis", b, metrics=metrics)
    tier.put(KEY, b"v")
    pauser = raw_client(redis_server)
    pauser.execute_command("CLIENT", "PAUSE", 700, "ALL")
    try:
        t0 = time.monotonic()
        assert tier.get(KEY) is None
        assert not tier.put("cd" * 16, b"w")
        assert time.monotonic() - t0 < 0.6
        assert sample(registry, "deepserve_kvstore_errors_total", tier="redis", op="get") == 1
    finally:
        pauser.execute_command("CLIENT", "UNPAUSE")
    time.sleep(0.1)
    assert tier.get(KEY) == b"v"


def test_concurrent_threads_during_outage_never_raise(redis_server: LocalRedisServer, prefix: str) -> None:
    cfg = KVStoreConfig(tiers=("redis",), redis_url=redis_server.url, redis_prefix=prefix, redis_retry_after_s=0.05)
    store = build_store(cfg, registry=CollectorRegistry())
    h = RecordHeader("block", "fp", "bfloat16", 0, 128)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(i: int) -> None:
        try:
            while not stop.is_set():
                key = f"{i:032x}"
                store.put(key, h, make_tensors())
                rec = store.get(key)
                assert rec is None or rec.header.key == key
        except BaseException as exc:  # noqa: BLE001 - any exception fails the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        redis_server.kill()
        time.sleep(0.3)
    finally:
        redis_server.restart()
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
