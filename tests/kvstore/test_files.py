"""SSD / shared-FS directory faults: torn writes, damaged files, full disks, concurrent writers."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore import KVStoreConfig, RecordHeader, build_store, decode_record
from kvstore.backends import FSBackend, RedisBackend, SSDBackend, filedir
from kvstore.backends.base import Backend
from kvstore.metrics import KVStoreMetrics
from kvstore.tier import Tier
from tests.kvstore.conftest import make_blob, make_tensors, sample

KEY = "ab" * 16


def k(i: int) -> str:
    return f"{i:032x}"


def final_path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.kv"


# --- torn and damaged files ----------------------------------------------------------------------
def test_partial_temp_file_is_never_read_and_is_swept(tmp_path: Path) -> None:
    (tmp_path / KEY[:2]).mkdir()
    tmp = tmp_path / KEY[:2] / f".{KEY}.host.123.abcd.tmp"
    tmp.write_bytes(make_blob(KEY)[:50])  # the writer died before its rename
    b = SSDBackend(tmp_path)
    assert b.get(KEY) is None and not b.contains(KEY) and b.keys() == [] and b.used_bytes() == 0
    assert tmp.exists()  # too young to sweep: a live writer may own it
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    SSDBackend(tmp_path)
    assert not tmp.exists()


@pytest.mark.parametrize("cut", [3, 24, 25, -1])
def test_truncated_final_file_is_a_miss_and_removed(
    tmp_path: Path, cut: int, metrics: KVStoreMetrics, registry: CollectorRegistry
) -> None:
    b = SSDBackend(tmp_path)
    tier = Tier("ssd", b, metrics=metrics)
    b.put(KEY, b"value" * 100)
    path = final_path(tmp_path, KEY)
    path.write_bytes(path.read_bytes()[:cut])  # e.g. a crash on a filesystem that lost the tail
    assert tier.get(KEY) is None
    assert not path.exists()
    assert sample(registry, "deepserve_kvstore_corrupt_records_total", tier="ssd") == 1


def test_bit_flip_caught_by_frame_checksum(tmp_path: Path) -> None:
    b = SSDBackend(tmp_path)
    b.put(KEY, b"value" * 100)
    path = final_path(tmp_path, KEY)
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x04
    path.write_bytes(bytes(raw))
    assert b.get(KEY) is None and not b.contains(KEY)


def test_store_ssd_bit_flip_is_a_miss_never_wrong_data(tmp_path: Path, registry: CollectorRegistry) -> None:
    store = build_store(KVStoreConfig(tiers=("ssd",), ssd_dir=str(tmp_path)), registry=registry)
    store.put(KEY, RecordHeader("block", "fp", "bfloat16", 0, 128), make_tensors())
    path = final_path(tmp_path, KEY)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # store-built ssd tiers rely on the record's own crc32
    path.write_bytes(bytes(raw))
    assert store.get(KEY) is None
    assert sample(registry, "deepserve_kvstore_corrupt_records_total", tier="ssd") == 1
    assert not path.exists()


def _write_forever(root: str, n_keys: int) -> None:
    b = SSDBackend(root)
    i = 0
    while True:
        key = k(i % n_keys)
        b.put(key, make_blob(key, rows=64, seed=i))
        i += 1


def test_writer_killed_mid_write_leaves_only_valid_files(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_write_forever, args=(str(tmp_path), 8))
    proc.start()
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    b = SSDBackend(tmp_path)
    keys = b.keys()
    assert keys, "the writer stored nothing"
    for key in keys:
        blob = b.get(key)
        assert blob is not None and decode_record(blob).header.key == key


# --- full disk and budgets ----------------------------------------------------------------------------
@pytest.fixture
def disk_capacity(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    """Make the filesystem under tmp_path look full beyond 5 KB: fsync fails with ENOSPC."""
    capacity = 5000
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        if used > capacity:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(filedir.os, "fsync", fsync)
    return capacity


def test_disk_full_evicts_then_misses(
    tmp_path: Path, disk_capacity: int, metrics: KVStoreMetrics, registry: CollectorRegistry
) -> None:
    tier = Tier("ssd", SSDBackend(tmp_path / "d"), metrics=metrics)  # no budget: only the disk limits
    for i in range(10):
        assert tier.put(k(i), bytes([i]) * 1000)
    held = tier.backend.keys()
    assert 2 <= len(held) < 10 and k(9) in held
    assert tier.get(k(0)) is None  # evicted: a miss, not an error
    assert sample(registry, "deepserve_kvstore_evictions_total", tier="ssd") >= 5
    assert not list((tmp_path / "d").rglob("*.tmp"))  # failed temp files are cleaned up


def test_disk_full_with_everything_pinned_drops_the_put(
    tmp_path: Path, disk_capacity: int, metrics: KVStoreMetrics, registry: CollectorRegistry
) -> None:
    tier = Tier("ssd", SSDBackend(tmp_path / "d"), metrics=metrics)
    for i in range(3):
        tier.put(k(i), bytes([i]) * 1500)
        tier.pin(k(i))
    assert not tier.put(k(7), b"x" * 1500)
    assert tier.get(k(7)) is None and sorted(tier.backend.keys()) == [k(0), k(1), k(2)]
    assert sample(registry, "deepserve_kvstore_rejected_puts_total", tier="ssd") == 1


# --- concurrent writers of one key in several processes ------------------------------------------------
def _make(kind: str, root: str, url: str, prefix: str) -> Backend:
    if kind == "ssd":
        return SSDBackend(root)
    if kind == "fs":
        return FSBackend(root)
    return RedisBackend(url, prefix=prefix, chunk_size=2000)


def _hammer(kind: str, root: str, url: str, prefix: str, seed: int, n: int) -> None:
    b = _make(kind, root, url, prefix)
    blob = make_blob(KEY, rows=64, seed=seed)
    for _ in range(n):
        b.put(KEY, blob)


@pytest.mark.parametrize("kind", ["ssd", "fs", pytest.param("redis", marks=pytest.mark.redis)])
def test_two_processes_write_the_same_key(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, prefix: str
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else ""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(kind, str(tmp_path), url, prefix, seed, 60)) for seed in (1, 2)]
    for p in procs:
        p.start()
    reader = _make(kind, str(tmp_path), url, prefix)
    valid = {make_blob(KEY, rows=64, seed=s) for s in (1, 2)}
    reads = 0
    while any(p.is_alive() for p in procs) or reads == 0:
        blob = reader.get(KEY)
        if blob is not None:
            assert blob in valid
            decode_record(blob)
            reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reader.get(KEY) in valid
    if kind != "redis":
        assert not list(tmp_path.rglob("*.tmp"))
