"""KVStoreConfig validation and environment parsing; the tier registry; build_store wiring."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore import KVStoreConfig, KVStoreConfigError, build_store, make_backend, register_backend
from kvstore import registry as registry_mod
from kvstore.backends import FSBackend, HostBackend, MemoryBackend, RedisBackend, SSDBackend
from kvstore.config import parse_bytes
from kvstore.eviction import LFUPolicy
from kvstore.metrics import KVStoreMetrics


def test_defaults_are_valid() -> None:
    cfg = KVStoreConfig()
    assert cfg.tiers == ("memory",) and cfg.budget_for("memory") == 4 << 30 and cfg.budget_for("redis") is None


@pytest.mark.parametrize("text,n", [("1024", 1024), ("4GiB", 4 << 30), ("512MB", 512 * 10**6), ("1.5KiB", 1536)])
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


def test_from_env() -> None:
    env = {
        "DEEPSERVE_KV_TIERS": "memory, ssd,redis",
        "DEEPSERVE_KV_SSD_DIR": "/nvme/kv",
        "DEEPSERVE_KV_SSD_BYTES": "200GiB",
        "DEEPSERVE_KV_MEMORY_BYTES": "none",
        "DEEPSERVE_KV_REDIS_URL": "redis://redis:6379/1",
        "DEEPSERVE_KV_REDIS_TTL_S": "0",
        "DEEPSERVE_KV_REDIS_TIMEOUT_S": "0.3",
        "DEEPSERVE_KV_PROMOTE": "false",
        "DEEPSERVE_KV_WRITE_MODE": "back",
        "DEEPSERVE_KV_CHUNK_BYTES": "1MiB",
        "DEEPSERVE_KV_DP_RANK": "3",
        "UNRELATED": "x",
    }
    cfg = KVStoreConfig.from_env(env, eviction="lfu")
    assert cfg.tiers == ("memory", "ssd", "redis")
    assert cfg.ssd_bytes == 200 << 30 and cfg.memory_bytes is None and cfg.chunk_bytes == 1 << 20
    assert cfg.redis_url == "redis://redis:6379/1" and cfg.redis_ttl_s == 0 and cfg.redis_timeout_s == 0.3
    assert cfg.promote is False and cfg.write_mode == "back" and cfg.dp_rank == 3 and cfg.eviction == "lfu"


@pytest.mark.parametrize(
    "env",
    [
        {"DEEPSERVE_KV_TIERS": "ssd"},  # no directory
        {"DEEPSERVE_KV_TIERS": "memory,memory"},
        {"DEEPSERVE_KV_TIERS": ""},
        {"DEEPSERVE_KV_MEMORY_BYTES": "lots"},
        {"DEEPSERVE_KV_PROMOTE": "maybe"},
        {"DEEPSERVE_KV_WRITE_MODE": "sideways"},
        {"DEEPSERVE_KV_MEMORY_BYTES": "0"},
    ],
)
def test_bad_config(env: dict[str, str]) -> None:
    with pytest.raises(KVStoreConfigError):
        KVStoreConfig.from_env(env)


def test_registry_builds_every_kind(tmp_path: Path) -> None:
    cfg = KVStoreConfig(
        tiers=("memory", "host", "ssd", "fs", "redis"),
        host_bytes=1 << 20,
        ssd_dir=str(tmp_path / "s"),
        fs_dir=str(tmp_path / "f"),
    )
    kinds = [type(make_backend(n, cfg)) for n in cfg.tiers]
    assert kinds == [MemoryBackend, HostBackend, SSDBackend, FSBackend, RedisBackend]
    with pytest.raises(KVStoreConfigError, match="unknown kv tier"):
        make_backend("tape", cfg)


def test_register_custom_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_mod, "BACKENDS", registry_mod.BackendRegistry())
    for name in ("memory", "scratch"):
        register_backend(name, lambda cfg: MemoryBackend())
    store = build_store(KVStoreConfig(tiers=("memory", "scratch")), registry=CollectorRegistry())
    assert [t.name for t in store.tiers] == ["memory", "scratch"]


def test_build_store_wires_budgets_and_policy(tmp_path: Path) -> None:
    cfg = KVStoreConfig(
        tiers=("memory", "ssd"), memory_bytes=1000, ssd_dir=str(tmp_path), ssd_bytes=5000, eviction="lfu"
    )
    store = build_store(cfg, registry=CollectorRegistry())
    assert [t.budget_bytes for t in store.tiers] == [1000, 5000]
    assert all(isinstance(t.policy, LFUPolicy) for t in store.tiers)
    assert all(t.events is store.events for t in store.tiers)


def test_metrics_share_the_global_registry() -> None:
    a, b = KVStoreMetrics(), KVStoreMetrics()  # the second must not fail with "Duplicated timeseries"
    assert a.hits is b.hits
