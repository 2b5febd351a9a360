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


def test_shared_tier_records_are_authenticated(tmp_path) -> None:
    """With an HMAC key the shared-dir tier keeps only records it (or a worker with the key)
    wrote: a forged value, an altered one or one moved under another key is a miss."""
    (tmp_path / "hmac").write_text("a-key-of-at-least-16-bytes\n")
    cfg = KVStoreConfig(tiers=("fs",), fs_dir=str(tmp_path / "shared"), fs_fsync=False, hmac_key_file=str(tmp_path / "hmac"))
    store = build_store(cfg)
    try:
        (tier,) = store.tiers
        sealed = tier.backend
        assert sealed.put(KEY, b"genuine") and sealed.get(KEY) == b"genuine"
        plain = FSBackend(tmp_path / "shared", fsync=False)  # an intruder without the key
        assert plain.get(KEY).startswith(b"genuine") and len(plain.get(KEY)) == len(b"genuine") + 32
        plain.put(KEY, b"forged" + b"\0" * 32)
        assert sealed.get(KEY) is None
        sealed.put(KEY, b"genuine")
        other = "ef" * 16
        plain.put(other, plain.get(KEY))  # a valid record copied under another key
        assert sealed.get(other) is None
        stored = bytearray(plain.get(KEY))
        stored[0] ^= 1  # one bit altered
        plain.put(KEY, bytes(stored))
        assert sealed.get_many([KEY, other, "00" * 16]) == [None, None, None]
    finally:
        store.close()
    (tmp_path / "short").write_text("short")
    with pytest.raises(KVStoreConfigError, match="16 bytes"):
        build_store(KVStoreConfig(tiers=("fs",), fs_dir=str(tmp_path / "s2"), hmac_key_file=str(tmp_path / "short")))
