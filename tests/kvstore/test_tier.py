"""A tier keeps its backend under budget by evicting policy victims, never pinned keys."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from kvstore.backends import HostBackend, MemoryBackend, SSDBackend
from kvstore.events import KVEventLog
from kvstore.eviction import LFUPolicy
from kvstore.metrics import KVStoreMetrics
from kvstore.tier import Tier
from tests.kvstore.conftest import sample


def k(i: int) -> str:
    return f"{i:032x}"


def test_budget_evicts_lru(metrics: KVStoreMetrics, registry: CollectorRegistry) -> None:
    events = KVEventLog()
    tier = Tier("memory", MemoryBackend(), budget_bytes=300, metrics=metrics, events=events)
    for i in range(3):
        assert tier.put(k(i), b"x" * 100)
    tier.get(k(0))  # k(1) is now the least recently used
    assert tier.put(k(3), b"y" * 100)
    assert tier.backend.keys() == [k(0), k(2), k(3)]
    assert tier.used_bytes() == 300
    assert sample(registry, "deepserve_kvstore_evictions_total", tier="memory") == 1
    assert sample(registry, "deepserve_kvstore_bytes_used", tier="memory") == 300
    removed = [e for e in events.since(0).events if e.kind == "removed"]
    assert [e.keys for e in removed] == [[k(1)]] and removed[0].tier == "memory"


def test_pinned_keys_are_never_evicted(metrics: KVStoreMetrics, registry: CollectorRegistry) -> None:
    tier = Tier("host", MemoryBackend(), budget_bytes=200, metrics=metrics)
    tier.put(k(0), b"a" * 100)
    tier.put(k(1), b"b" * 100)
    tier.pin(k(0))
    tier.pin(k(1))
    assert not tier.put(k(2), b"c" * 100)  # no room: everything pinned
    assert sample(registry, "deepserve_kvstore_rejected_puts_total", tier="host") == 1
    tier.unpin(k(1))
    assert tier.put(k(2), b"c" * 100)
    assert sorted(tier.backend.keys()) == [k(0), k(2)]


def test_value_larger_than_budget_is_rejected(metrics: KVStoreMetrics) -> None:
    tier = Tier("memory", MemoryBackend(), budget_bytes=100, metrics=metrics)
    tier.put(k(0), b"a" * 50)
    assert not tier.put(k(1), b"b" * 101)
    assert tier.backend.keys() == [k(0)]  # nothing was evicted for a hopeless put


def test_existing_key_is_not_rewritten(metrics: KVStoreMetrics) -> None:
    events = KVEventLog()
    tier = Tier("memory", MemoryBackend(), metrics=metrics, events=events)
    tier.put(k(0), b"first")
    tier.put(k(0), b"second")
    assert tier.get(k(0)) == b"first"
    tier.put(k(0), b"third", overwrite=True)
    assert tier.get(k(0)) == b"third"
    assert [e.kind for e in events.since(0).events] == ["stored", "stored"]


def test_backend_full_triggers_eviction_and_retry(metrics: KVStoreMetrics, registry: CollectorRegistry) -> None:
    tier = Tier("host", HostBackend(250), metrics=metrics)  # no tier budget: only the pool's cap
    tier.put(k(0), b"a" * 100)
    tier.put(k(1), b"b" * 100)
    assert tier.put(k(2), b"c" * 100)
    assert sorted(tier.backend.keys()) == [k(1), k(2)]
    assert sample(registry, "deepserve_kvstore_evictions_total", tier="host") == 1


def test_lfu_policy_in_a_tier(metrics: KVStoreMetrics) -> None:
    tier = Tier("memory", MemoryBackend(), budget_bytes=200, policy=LFUPolicy(), metrics=metrics)
    tier.put(k(0), b"a" * 100)
    tier.put(k(1), b"b" * 100)
    tier.get(k(0))
    tier.get(k(0))
    tier.get(k(1))
    tier.put(k(2), b"c" * 100)
    assert sorted(tier.backend.keys()) == [k(0), k(2)]


def test_ssd_budget_counts_files_from_a_previous_run(tmp_path: Path, metrics: KVStoreMetrics) -> None:
    first = SSDBackend(tmp_path)
    for i in range(3):
        first.put(k(i), b"z" * 100)
    tier = Tier("ssd", SSDBackend(tmp_path), budget_bytes=300, metrics=metrics)
    assert tier.used_bytes() == 300
    assert tier.put(k(9), b"n" * 100)
    assert tier.used_bytes() == 300 and len(tier.backend.keys()) == 3 and tier.backend.contains(k(9))


def test_read_bandwidth_estimate(metrics: KVStoreMetrics) -> None:
    tier = Tier("memory", MemoryBackend(), metrics=metrics)
    assert tier.read_bytes_per_s is None
    tier.put(k(0), b"x" * 100_000)
    tier.get(k(1))  # a miss teaches nothing
    assert tier.read_bytes_per_s is None
    tier.get(k(0))
    assert tier.read_bytes_per_s is not None and tier.read_bytes_per_s > 0
