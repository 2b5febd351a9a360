"""Tier kinds by name: ``name -> factory(config) -> Backend``.

``build_store`` (kvstore.store) looks every name of ``KVStoreConfig.tiers`` up here. A deployment
adds a kind (an RDMA transfer engine, a Mooncake client) with ``register_backend`` before building.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstore.backends import Backend, FSBackend, HostBackend, MemoryBackend, RedisBackend, SSDBackend
from kvstore.backends.sealed import SealedBackend
from kvstore.config import KVStoreConfig
from kvstore.errors import KVStoreConfigError

BackendFactory = Callable[[KVStoreConfig], Backend]


def _memory(cfg: KVStoreConfig) -> Backend:
    return MemoryBackend()


def _host(cfg: KVStoreConfig) -> Backend:
    if cfg.host_bytes is None:
        raise KVStoreConfigError("tier 'host' needs a byte budget (host_bytes)")
    return HostBackend(cfg.host_bytes)


# Records carry their own crc32, which the store verifies on every read, so the file frame's
# duplicate checksum is off for store-built directory tiers (its length check stays).
def _ssd(cfg: KVStoreConfig) -> Backend:
    return SSDBackend(cfg.ssd_dir, checksum=False, fsync=cfg.ssd_fsync)


def _fs(cfg: KVStoreConfig) -> Backend:
    return FSBackend(cfg.fs_dir, checksum=False, fsync=cfg.fs_fsync)


def _redis(cfg: KVStoreConfig) -> Backend:
    password = None
    if cfg.redis_password_file:
        try:
            password = Path(cfg.redis_password_file).read_text().strip()
        except OSError as exc:
            raise KVStoreConfigError(f"cannot read redis_password_file {cfg.redis_password_file}: {exc}") from exc
    return RedisBackend(
        cfg.redis_url,
        password=password,
        tls_ca_file=cfg.redis_tls_ca_file or None,
        prefix=cfg.redis_prefix,
        ttl_s=cfg.redis_ttl_s,
        chunk_size=cfg.chunk_bytes,
        connect_timeout_s=cfg.redis_connect_timeout_s,
        timeout_s=cfg.redis_timeout_s,
        retry_after_s=cfg.redis_retry_after_s,
    )


SHARED_TIERS = frozenset({"redis", "fs"})  # reachable by other hosts: authenticated with hmac_key_file


class BackendRegistry:
    """A name -> factory map with a helpful error for unknown names."""

    def __init__(self) -> None:
        self._factories: dict[str, BackendFactory] = {}

    def register(self, name: str, factory: BackendFactory) -> None:
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, config: KVStoreConfig) -> Backend:
        """A backend of kind ``name``; a shared one sealed with HMACs when ``hmac_key_file`` is set."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise KVStoreConfigError(f"unknown kv tier {name!r}; known: {self.names()}") from None
        backend = factory(config)
        if config.hmac_key_file and name in SHARED_TIERS:
            try:
                secret = Path(config.hmac_key_file).read_bytes().strip()
                return SealedBackend(backend, secret)
            except (OSError, ValueError) as exc:
                backend.close()
                raise KVStoreConfigError(f"hmac_key_file {config.hmac_key_file}: {exc}") from exc
        return backend


BACKENDS = BackendRegistry()
for _name, _factory in {"memory": _memory, "host": _host, "ssd": _ssd, "fs": _fs, "redis": _redis}.items():
    BACKENDS.register(_name, _factory)


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``name`` usable in ``KVStoreConfig.tiers``."""
    BACKENDS.register(name, factory)


def make_backend(name: str, config: KVStoreConfig) -> Backend:
    """A new backend of kind ``name`` configured from ``config``."""
    return BACKENDS.create(name, config)
