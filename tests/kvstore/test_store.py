"""TieredStore: promotion, write modes, budgets, corrupt copies, prefix lookups, events."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvstore import KVStoreConfig, RecordHeader, TieredStore, build_store, chain_keys
from kvstore.backends import MemoryBackend
from kvstore.metrics import KVStoreMetrics
from kvstore.record import encode_record
from kvstore.tier import Tier
from tests.kvstore.conftest import make_tensors, sample

FP = "tiny-v4:test"


def header(i: int, kind: str = "block") -> RecordHeader:
    return RecordHeader(kind=kind, fingerprint=FP, dtype="bfloat16", token_start=128 * i, token_end=128 * (i + 1))  # type: ignore[arg-type]


def three_tiers(tmp_path: Path, registry: CollectorRegistry, **cfg: object) -> TieredStore:
    config = KVStoreConfig(tiers=("memory", "host", "ssd"), ssd_dir=str(tmp_path / "ssd"), **cfg)  # type: ignore[arg-type]
    return build_store(config, registry=registry)


def test_put_get_round_trip_sets_key(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    t = make_tensors()
    assert store.put("k" * 32, header(0), t)
    rec = store.get("k" * 32)
    assert rec is not None and rec.header.key == "k" * 32 and rec.header.fingerprint == FP
    assert all(torch.equal(rec.tensors[n], t[n]) for n in t)
    assert store.get("m" * 32) is None
    assert sample(registry, "deepserve_kvstore_hits_total", tier="memory") == 1
    for tier in ("memory", "host", "ssd"):
        assert sample(registry, "deepserve_kvstore_misses_total", tier=tier) == 1


def test_write_through_fills_every_tier(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    store.put("a" * 32, header(0), make_tensors())
    assert [t.backend.contains("a" * 32) for t in store.tiers] == [True, True, True]
    assert store.used_bytes()["ssd"] == store.used_bytes()["memory"] > 0


def test_read_through_promotion(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    store.put("a" * 32, header(0), make_tensors())
    store.tiers[0].remove("a" * 32)
    store.tiers[1].remove("a" * 32)
    assert store.get("a" * 32) is not None
    assert sample(registry, "deepserve_kvstore_hits_total", tier="ssd") == 1
    assert [t.backend.contains("a" * 32) for t in store.tiers] == [True, True, True]
    assert store.get("a" * 32) is not None
    assert sample(registry, "deepserve_kvstore_hits_total", tier="memory") == 1


def test_no_promotion_when_disabled(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry, promote=False)
    store.put("a" * 32, header(0), make_tensors())
    store.tiers[0].remove("a" * 32)
    assert store.get("a" * 32) is not None and not store.tiers[0].backend.contains("a" * 32)


def test_write_back_reaches_slower_tiers_after_flush(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry, write_mode="back")
    keys = [f"{i:032x}" for i in range(10)]
    for i, key in enumerate(keys):
        assert store.put(key, header(i), make_tensors(seed=i))
    store.flush()
    assert all(store.tiers[2].backend.contains_many(keys))
    store.close()


def test_budgets_evict_per_tier_and_lower_tiers_still_serve(tmp_path: Path, registry: CollectorRegistry) -> None:
    size = len(encode_record(replace(header(0), key="0" * 32), make_tensors()))
    store = three_tiers(tmp_path, registry, memory_bytes=2 * size, host_bytes=4 * size, ssd_bytes=8 * size)
    keys = [f"{i:032x}" for i in range(10)]
    for i, key in enumerate(keys):
        store.put(key, header(i), make_tensors())
    assert [len(t.backend.keys()) for t in store.tiers] == [2, 4, 8]
    assert all(u <= b for u, b in zip(store.used_bytes().values(), (2 * size, 4 * size, 8 * size)))
    assert sample(registry, "deepserve_kvstore_evictions_total", tier="ssd") == 2
    # The two oldest fell out of every tier: misses, not errors.
    assert store.get(keys[0]) is None and store.get(keys[1]) is None
    assert store.get(keys[2]) is not None  # from ssd, promoted
    assert store.longest_prefix(keys) == 0 and store.longest_prefix(keys[2:]) == 8


def test_corrupt_copy_is_a_miss_removed_and_counted(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    key = "c" * 32
    store.put(key, header(0), make_tensors())
    good = store.tiers[0].backend.get(key)
    assert good is not None
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    store.tiers[0].backend.put(key, bytes(bad))  # bit rot in memory
    store.tiers[1].backend.put(key, bytes(bad[:-10]))  # truncated in host
    rec = store.get(key)  # served from ssd, and the good copy is promoted again
    assert rec is not None
    assert sample(registry, "deepserve_kvstore_corrupt_records_total", tier="memory") == 1
    assert sample(registry, "deepserve_kvstore_corrupt_records_total", tier="host") == 1
    assert store.tiers[0].backend.get(key) == good


def test_record_under_the_wrong_key_is_rejected(registry: CollectorRegistry) -> None:
    store = build_store(KVStoreConfig(), registry=registry)
    store.put("a" * 32, header(0), make_tensors())
    store.tiers[0].backend.put("b" * 32, store.tiers[0].backend.get("a" * 32))  # type: ignore[arg-type]
    assert store.get("b" * 32) is None
    assert sample(registry, "deepserve_kvstore_corrupt_records_total", tier="memory") == 1


def test_get_many_across_tiers(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    keys = [f"{i:032x}" for i in range(4)]
    for i, key in enumerate(keys[:3]):
        store.put(key, header(i), make_tensors(seed=i))
    store.tiers[0].remove(keys[1])
    store.tiers[0].remove(keys[2])
    store.tiers[1].remove(keys[2])
    recs = store.get_many(keys)
    assert [r is not None for r in recs] == [True, True, True, False]
    assert [r.header.token_start for r in recs if r is not None] == [0, 128, 256]


def test_longest_prefix_with_chained_keys(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    tokens = list(range(128 * 5))
    keys = chain_keys(tokens, 128, FP)
    for i, key in enumerate(keys[:3]):
        store.put(key, header(i), make_tensors())
    store.tiers[0].remove(keys[1])  # still in host and ssd
    store.tiers[0].remove(keys[2])
    store.tiers[1].remove(keys[2])
    assert store.longest_prefix(keys) == 3
    other = chain_keys([7] + tokens[1:], 128, FP)  # first token differs: nothing shared
    assert store.longest_prefix(other) == 0
    assert store.longest_prefix([]) == 0
    store.remove(keys[1])
    assert store.longest_prefix(keys) == 1 and not store.contains(keys[1])


def test_events_ring_and_subscribers(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = build_store(
        KVStoreConfig(tiers=("memory", "ssd"), ssd_dir=str(tmp_path), event_ring=3, dp_rank=2), registry=registry
    )
    heard: list[tuple[int, str, str]] = []
    unsubscribe = store.subscribe(lambda seq, e: heard.append((seq, e.kind, e.tier)))
    store.put("a" * 32, header(0), make_tensors())
    store.remove("a" * 32)
    assert heard == [(1, "stored", "memory"), (2, "stored", "ssd"), (3, "removed", "memory"), (4, "removed", "ssd")]
    batch = store.events.since(2)
    assert batch.seq == 4 and batch.complete and [e.kind for e in batch.events] == ["removed", "removed"]
    assert batch.events[0].keys == ["a" * 32] and batch.events[0].dp_rank == 2
    assert not store.events.since(0).complete  # event 1 fell out of the 3-slot ring
    assert store.events.since(4).events == []
    unsubscribe()
    store.put("b" * 32, header(0), make_tensors())
    assert len(heard) == 4


def test_subscriber_errors_do_not_break_puts(registry: CollectorRegistry) -> None:
    store = build_store(KVStoreConfig(), registry=registry)

    def boom(seq: int, e: object) -> None:
        raise RuntimeError("subscriber bug")

    store.subscribe(boom)
    assert store.put("a" * 32, header(0), make_tensors())


def test_put_many_batches(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = three_tiers(tmp_path, registry)
    keys = [f"{i:032x}" for i in range(5)]
    assert store.put_many([(key, header(i), make_tensors(seed=i)) for i, key in enumerate(keys)]) == [True] * 5
    events = store.events.since(0).events
    assert [(e.tier, len(e.keys)) for e in events] == [("memory", 5), ("host", 5), ("ssd", 5)]


def test_pins_protect_across_tiers(registry: CollectorRegistry) -> None:
    metrics = KVStoreMetrics(registry)
    tiers = [Tier("memory", MemoryBackend(), budget_bytes=10_000, metrics=metrics)]
    store = TieredStore(tiers)
    store.put("p" * 32, header(0), make_tensors(rows=4))
    store.pin(["p" * 32])
    for i in range(20):
        store.put(f"{i:032x}", header(i), make_tensors(rows=4))
    assert store.get("p" * 32) is not None
    store.unpin(["p" * 32])
    for i in range(20, 40):
        store.put(f"{i:032x}", header(i), make_tensors(rows=4))
    assert store.get("p" * 32) is None


def test_store_needs_tiers() -> None:
    with pytest.raises(ValueError):
        TieredStore([])
