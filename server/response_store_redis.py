"""Stored Responses in a Redis-protocol server (Redis, Valkey): one store shared by every gateway
pointed at it, so a response created through one gateway is read, continued, cancelled or deleted
through any other.

Layout: one string per record, ``{prefix}:{response id}`` -> the record's JSON
(``StoredResponse.to_json``), written by one ``SET ... PX ttl`` (a record is never half-written and
the server expires it; every write starts its TTL again). A conditional write (``if_running``)
is ``WATCH`` / ``GET`` / ``MULTI`` / ``SET`` / ``EXEC``: it fails, and is retried, when another
gateway changed the record in between, so a cancel or delete is never overwritten by the run.
The count of records is left to the server's ``maxmemory`` policy; ``max_bytes`` bounds one record.

The connection settings are the KV store's (``kvstore.config.KVStoreConfig``: ``redis_url``,
``redis_password_file``, ``redis_tls_ca_file``, timeouts), so a stack configures Redis once.
Any failure to reach the server is ``StoreUnavailable`` (503).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from kvstore.config import KVStoreConfig
from server.response_store import ResponseStoreConfig, StoredResponse, StoreUnavailable

_WATCH_RETRIES = 16


class RedisResponseStore:
    """``ResponseStore`` over a Redis-protocol server; see the module docstring."""

    def __init__(self, config: ResponseStoreConfig, client: aioredis.Redis, prefix: str = "deepserve:responses") -> None:
        self.config = config
        self.prefix = prefix
        self._client = client

    @classmethod
    def from_kv_config(cls, config: ResponseStoreConfig, kv: KVStoreConfig, prefix: str) -> RedisResponseStore:
        """A store on the server the KV tiers use, with their password file and TLS CA."""
        options: dict[str, Any] = {"socket_connect_timeout": max(kv.redis_connect_timeout_s, 1.0), "socket_timeout": max(kv.redis_timeout_s, 2.0)}
        if kv.redis_password_file:
            try:
                options["password"] = Path(kv.redis_password_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read redis_password_file {kv.redis_password_file}: {exc}") from exc
        if kv.redis_tls_ca_file:
            options["ssl_ca_certs"] = kv.redis_tls_ca_file
        return cls(config, aioredis.Redis.from_url(kv.redis_url, **options), prefix)

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:{response_id}"

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            raw = await self._client.get(self.key(response_id))
        except (redis.RedisError, OSError) as exc:
            raise _unavailable(exc) from exc
        return None if raw is None else StoredResponse.from_json(raw)

    async def put(self, entry: StoredResponse, *, if_running: bool = False) -> bool:
        text = entry.to_json()
        key, ttl_ms = self.key(entry.id), max(1, int(self.config.ttl_s * 1000))
        try:
            if len(text.encode()) > self.config.max_bytes:
                if not if_running:
                    await self._client.delete(key)  # as the embedded store: the old record goes too
                return False
            if not if_running:
                await self._client.set(key, text, px=ttl_ms)
                return True
            return await self._put_if_running(key, text, ttl_ms)
        except (redis.RedisError, OSError) as exc:
            raise _unavailable(exc) from exc

    async def _put_if_running(self, key: str, text: str, ttl_ms: int) -> bool:
        async with self._client.pipeline(transaction=True) as pipe:
            for _ in range(_WATCH_RETRIES):
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None or not StoredResponse.from_json(raw).running:
                        await pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.set(key, text, px=ttl_ms)
                    await pipe.execute()
                    return True
                except redis.WatchError:
                    continue  # another gateway wrote the record in between: look again
        raise StoreUnavailable("The response store is busy: the record kept changing; try again.")

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self._client.delete(self.key(response_id)))
        except (redis.RedisError, OSError) as exc:
            raise _unavailable(exc) from exc

    async def close(self) -> None:
        await self._client.aclose()


def _unavailable(exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"The response store is unavailable ({type(exc).__name__}); try again.", retry_after=1.0)


def open_response_store(choice: str, config: ResponseStoreConfig, kv: KVStoreConfig, prefix: str) -> Any:
    """The store a gateway uses: ``redis`` (the KV store's server), ``memory`` (embedded), or
    ``auto``: redis when the KV tiers include it (the stack has a Redis), else memory."""
    from server.response_store import MemoryResponseStore

    if choice == "redis" or (choice == "auto" and "redis" in kv.tiers):
        return RedisResponseStore.from_kv_config(config, kv, prefix)
    return MemoryResponseStore(config)
