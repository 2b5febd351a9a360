"""One contract, every backend (memory, host, ssd, fs and a real Redis server)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.backends import Backend, FSBackend, HostBackend, MemoryBackend, RedisBackend, SSDBackend
from kvstore.errors import BackendFull, InvalidKey
from bench.localredis import LocalRedisServer

KINDS = ["memory", "host", "ssd", "fs", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Iterator[Backend]:
    kind = request.param
    if kind == "memory":
        b: Backend = MemoryBackend()
    elif kind == "host":
        b = HostBackend(64 << 20)
    elif kind == "ssd":
        b = SSDBackend(tmp_path / "ssd")
    elif kind == "fs":
        b = FSBackend(tmp_path / "fs")
    else:
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        b = RedisBackend(server.url, prefix=prefix, chunk_size=1000, ttl_s=60)
    yield b
    b.close()


def k(i: int) -> str:
    return f"{i:032x}"


def test_put_get_contains_remove(backend: Backend) -> None:
    assert not backend.contains(k(1)) and backend.get(k(1)) is None
    assert backend.put(k(1), b"hello")
    assert backend.contains(k(1)) and backend.get(k(1)) == b"hello"
    assert backend.remove(k(1))
    assert not backend.contains(k(1)) and backend.get(k(1)) is None
    assert not backend.remove(k(1))


def test_values_of_every_size_round_trip(backend: Backend) -> None:
    values = {k(i): os.urandom(n) for i, n in enumerate([0, 1, 999, 1000, 1001, 2000, 4567, 300_000])}
    for key, v in values.items():
        assert backend.put(key, v)
    for key, v in values.items():
        assert backend.get(key) == v, len(v)


def test_overwrite_replaces_value_and_accounting(backend: Backend) -> None:
    backend.put(k(1), b"a" * 5000)
    backend.put(k(1), b"b" * 10)  # chunked -> inline for redis
    assert backend.get(k(1)) == b"b" * 10
    backend.put(k(1), b"c" * 3000)  # inline -> chunked
    assert backend.get(k(1)) == b"c" * 3000
    assert backend.used_bytes() == 3000
    backend.remove(k(1))
    assert backend.used_bytes() == 0


def test_batched_operations(backend: Backend) -> None:
    items = [(k(i), bytes([i]) * (i * 700)) for i in range(1, 6)]
    assert backend.put_many(items) == [True] * 5
    keys = [k(i) for i in range(0, 7)]
    assert backend.contains_many(keys) == [False, True, True, True, True, True, False]
    assert backend.get_many(keys) == [None, *[v for _, v in items], None]
    assert backend.get_many([]) == [] and backend.contains_many([]) == [] and backend.put_many([]) == []


def test_keys_entries_and_used_bytes(backend: Backend) -> None:
    backend.put(k(1), b"x" * 100)
    backend.put(k(2), b"y" * 2500)
    assert sorted(backend.keys()) == [k(1), k(2)]
    assert dict(backend.entries()) == {k(1): 100, k(2): 2500}
    assert backend.used_bytes() == 2600


def test_pins_nest(backend: Backend) -> None:
    backend.put(k(1), b"v")
    backend.pin(k(1))
    backend.pin(k(1))
    backend.unpin(k(1))
    assert backend.is_pinned(k(1))
    backend.unpin(k(1))
    assert not backend.is_pinned(k(1))
    assert backend.get(k(1)) == b"v"


def test_concurrent_threads_same_key(backend: Backend) -> None:
    values = [bytes([i]) * 3000 for i in range(4)]

    def writer(v: bytes) -> None:
        for _ in range(10):
            backend.put(k(9), v)

    threads = [threading.Thread(target=writer, args=(v,)) for v in values]
    for t in threads:
        t.start()
    for _ in range(20):
        got = backend.get(k(9))
        assert got is None or got in values
    for t in threads:
        t.join()
    assert backend.get(k(9)) in values


def test_host_budget_is_hard() -> None:
    b = HostBackend(1000)
    b.put(k(1), b"x" * 600)
    with pytest.raises(BackendFull):
        b.put(k(2), b"y" * 600)
    b.put(k(1), b"z" * 1000)  # replacing frees the old value first
    assert b.used_bytes() == 1000 and b.get(k(1)) == b"z" * 1000
    with pytest.raises(BackendFull):
        b.put(k(3), b"w" * 1001)


@pytest.mark.parametrize("cls", [SSDBackend, FSBackend])
def test_directory_rejects_unsafe_keys(cls: type, tmp_path: Path) -> None:
    b = cls(tmp_path)
    for bad in ["", "../etc/passwd", "a/b", ".hidden"]:
        with pytest.raises(InvalidKey):
            b.put(bad, b"v")


@pytest.mark.parametrize("cls", [SSDBackend, FSBackend])
def test_directory_state_survives_reopen(cls: type, tmp_path: Path) -> None:
    cls(tmp_path).put(k(1), b"persist" * 10)
    again = cls(tmp_path)
    assert again.get(k(1)) == b"persist" * 10 and again.used_bytes() == 70
