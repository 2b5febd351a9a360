"""KV files are the owner's only (0600 files, 0700 directories: they hold users' prompts), and the
Redis tier authenticates to a server that requires a password (a real server, ``--requirepass``)."""

from __future__ import annotations

import os
import stat

import pytest

from bench.localredis import LocalRedisServer, find_server_binary
from kvstore import KVStoreConfig, build_store
from kvstore.backends import FSBackend, RedisBackend, SSDBackend
from kvstore.errors import KVStoreConfigError

KEY = "cd" * 16


@pytest.mark.parametrize("cls", [SSDBackend, FSBackend])
def test_files_and_directories_are_private(tmp_path, cls) -> None:
    old = os.umask(0o022)  # a permissive umask, as most shells have
    try:
        b = cls(tmp_path / "kv", fsync=False)
        assert b.put(KEY, b"secret prompt state")
    finally:
        os.umask(old)
    (path,) = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert b.get(KEY) == b"secret prompt state"


@pytest.mark.redis
@pytest.mark.skipif(find_server_binary() is None, reason="no redis-server / valkey-server")
def test_redis_tier_with_a_password(tmp_path) -> None:
    server = LocalRedisServer(extra_args=("--requirepass", "kv-pass")).start()
    try:
        anonymous = RedisBackend(server.url, prefix="h1")
        assert not anonymous.put(KEY, b"x") and anonymous.get(KEY) is None  # refused, not raised
        (tmp_path / "pw").write_text("kv-pass\n")
        cfg = KVStoreConfig(tiers=("redis",), redis_url=server.url, redis_prefix="h2", redis_password_file=str(tmp_path / "pw"))
        store = build_store(cfg)
        try:
            (backend,) = [t.backend for t in store.tiers]
            assert backend.put(KEY, b"value") and backend.get(KEY) == b"value"
        finally:
            store.close()
    finally:
        server.stop()


def test_redis_options_are_checked() -> None:
    with pytest.raises(KVStoreConfigError, match="rediss://"):
        KVStoreConfig(tiers=("redis",), redis_tls_ca_file="/ca.pem")
    KVStoreConfig(tiers=("redis",), redis_url="rediss://r:6380/0", redis_tls_ca_file="/ca.pem")
    with pytest.raises(KVStoreConfigError, match="redis_password_file"):
        build_store(KVStoreConfig(tiers=("redis",), redis_password_file="/no/such/file"))
