"""KVEventLog: events name the rank they happened for; removals reach every announcing rank; the
snapshot a poller rebuilds from after falling behind the ring."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from kvstore import KVStoreConfig, RecordHeader, build_store
from kvstore.events import KVEventLog
from tests.kvstore.conftest import make_tensors


def _rows(events) -> list[tuple[str, str, int, list[str]]]:
    return [(e.kind, e.tier, e.dp_rank, e.keys) for e in events]


def test_stored_events_name_the_writing_rank_and_removals_every_holder() -> None:
    log = KVEventLog(capacity=16, dp_rank=0)
    log.publish("stored", ["a", "b"], "memory", dp_rank=1)
    log.publish("stored", ["b"], "memory", dp_rank=3)
    log.publish("stored", ["c"], "memory")  # no rank: the log's default
    log.publish("removed", ["a", "b", "c", "z"], "memory")  # z was never announced
    assert _rows(log.since(0).events) == [
        ("stored", "memory", 1, ["a", "b"]),
        ("stored", "memory", 3, ["b"]),
        ("stored", "memory", 0, ["c"]),
        ("removed", "memory", 0, ["c", "z"]),
        ("removed", "memory", 1, ["a", "b"]),
        ("removed", "memory", 3, ["b"]),
    ]
    assert log.snapshot().events == [] and log.seq == 6


def test_snapshot_is_what_is_held_at_its_seq() -> None:
    log = KVEventLog(capacity=2)
    log.publish("stored", ["a", "b"], "memory", dp_rank=0)
    log.publish("stored", ["b", "c"], "memory", dp_rank=1)
    log.publish("stored", ["c"], "ssd", dp_rank=1)
    log.publish("removed", ["a"], "memory")
    assert not log.since(0).complete  # the ring kept 2 of 4 events
    snap = log.snapshot()
    assert snap.complete and snap.seq == 4
    assert _rows(snap.events) == [("stored", "memory", 0, ["b"]), ("stored", "memory", 1, ["b", "c"]), ("stored", "ssd", 1, ["c"])]
    log.publish("removed", ["c"], "ssd")
    assert _rows(log.since(snap.seq).events) == [("removed", "ssd", 1, ["c"])]


def _header(i: int) -> RecordHeader:
    return RecordHeader(kind="block", fingerprint="fp", dtype="bfloat16", token_start=128 * i, token_end=128 * (i + 1))


def test_store_tags_puts_and_promotions_with_the_callers_rank(tmp_path: Path) -> None:
    cfg = KVStoreConfig(tiers=("memory", "ssd"), ssd_dir=str(tmp_path), dp_rank=0)
    store = build_store(cfg, registry=CollectorRegistry())
    store.put_many([("a" * 32, _header(0), make_tensors())], dp_rank=2)
    store.tiers[0].remove("a" * 32)  # only the SSD copy is left
    assert store.get_many(["a" * 32], dp_rank=5)[0] is not None  # promoted into memory for rank 5
    assert _rows(store.events.since(0).events) == [
        ("stored", "memory", 2, ["a" * 32]),
        ("stored", "ssd", 2, ["a" * 32]),
        ("removed", "memory", 2, ["a" * 32]),
        ("stored", "memory", 5, ["a" * 32]),
    ]
    assert _rows(store.events.snapshot().events) == [("stored", "memory", 5, ["a" * 32]), ("stored", "ssd", 2, ["a" * 32])]


def test_write_back_keeps_the_rank(tmp_path: Path) -> None:
    cfg = KVStoreConfig(tiers=("memory", "ssd"), ssd_dir=str(tmp_path), write_mode="back")
    with build_store(cfg, registry=CollectorRegistry()) as store:
        store.put_many([("b" * 32, _header(0), make_tensors())], dp_rank=1)
        store.flush()
        assert _rows(store.events.since(0).events) == [("stored", "memory", 1, ["b" * 32]), ("stored", "ssd", 1, ["b" * 32])]
