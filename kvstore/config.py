"""``KVStoreConfig``: the store's settings, validated on creation, readable from the environment.

Every field ``f`` can be set by the environment variable ``DEEPSERVE_KV_<F>`` (upper case), e.g.
``DEEPSERVE_KV_TIERS=memory,ssd,redis``, ``DEEPSERVE_KV_SSD_DIR=/nvme/kv``,
``DEEPSERVE_KV_SSD_BYTES=200GiB``, ``DEEPSERVE_KV_REDIS_URL=redis://redis:6379/0``,
``DEEPSERVE_KV_REDIS_TTL_S=0`` (no expiry). Byte sizes take plain integers or ``KB/MB/GB/TB``
(powers of 1000) and ``KiB/MiB/GiB/TiB`` (powers of 1024) suffixes; ``none`` means no budget.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from kvstore.errors import KVStoreConfigError

WriteMode = Literal["through", "back"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """``"4GiB"`` -> 4294967296; ``"512MB"`` -> 512000000; ``"1024"`` -> 1024."""
    m = _SIZE_RE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise KVStoreConfigError(f"not a byte size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class KVStoreConfig:
    """Tiers, fastest first, and each tier's settings. Budgets are bytes; ``None`` = unbounded."""

    tiers: tuple[str, ...] = ("memory",)
    # Budgets per tier (the tier evicts to stay under them).
    memory_bytes: int | None = 4 << 30
    host_bytes: int | None = 16 << 30
    ssd_bytes: int | None = 256 << 30
    fs_bytes: int | None = None  # shared: bounded by the filesystem, not by one worker
    redis_bytes: int | None = None  # shared: bounded by Redis' maxmemory policy
    eviction: str = "lru"
    # Data movement between tiers.
    write_mode: WriteMode = "through"  # "back": put returns after the first tier, a thread copies down
    promote: bool = True  # copy a hit into every faster tier
    writeback_queue: int = 64  # records waiting for the write-back thread before put blocks
    # Local SSD and shared filesystem directories.
    ssd_dir: str = ""
    ssd_fsync: bool = True
    fs_dir: str = ""
    fs_fsync: bool = True
    # Redis.
    redis_url: str = "redis://localhost:6379/0"
    redis_prefix: str = "deepserve:kv"
    redis_ttl_s: int | None = 3600
    redis_connect_timeout_s: float = 0.25
    redis_timeout_s: float = 1.0
    redis_retry_after_s: float = 1.0  # after a failure, skip Redis for this long
    # A shared Redis: its password from a file (a mounted Secret; not in the URL or the
    # environment), and for a rediss:// (TLS) URL the CA that signs the server's certificate.
    redis_password_file: str = ""
    redis_tls_ca_file: str = ""
    # A key (file; at least 16 bytes) that authenticates every record on the shared tiers (redis,
    # fs) with an HMAC (kvstore/backends/sealed.py): a record anyone else wrote there is a miss.
    hmac_key_file: str = ""
    chunk_bytes: int = 4 << 20  # Redis values above this are split into chunks
    # Events for the router.
    event_ring: int = 4096
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.tiers, str):
            object.__setattr__(self, "tiers", tuple(t.strip() for t in self.tiers.split(",") if t.strip()))
        if not self.tiers:
            raise KVStoreConfigError("at least one tier is needed")
        if len(set(self.tiers)) != len(self.tiers):
            raise KVStoreConfigError(f"duplicate tiers in {self.tiers}")
        if "ssd" in self.tiers and not self.ssd_dir:
            raise KVStoreConfigError("tier 'ssd' needs ssd_dir (DEEPSERVE_KV_SSD_DIR)")
        if "fs" in self.tiers and not self.fs_dir:
            raise KVStoreConfigError("tier 'fs' needs fs_dir (DEEPSERVE_KV_FS_DIR)")
        if self.redis_tls_ca_file and not self.redis_url.startswith("rediss://"):
            raise KVStoreConfigError("redis_tls_ca_file needs a rediss:// (TLS) redis_url")
        if self.write_mode not in ("through", "back"):
            raise KVStoreConfigError(f"write_mode must be 'through' or 'back', got {self.write_mode!r}")
        if self.chunk_bytes <= 0 or self.event_ring <= 0 or self.writeback_queue <= 0:
            raise KVStoreConfigError("chunk_bytes, event_ring and writeback_queue must be > 0")
        for t in self.tiers:
            budget = self.budget_for(t)
            if budget is not None and budget <= 0:
                raise KVStoreConfigError(f"budget of tier {t!r} must be > 0 or None")

    def budget_for(self, tier: str) -> int | None:
        """The byte budget of ``tier`` (``None`` for unbudgeted or unknown tiers)."""
        return getattr(self, f"{tier}_bytes", None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> KVStoreConfig:
        """Defaults, then ``DEEPSERVE_KV_*`` variables, then ``overrides``."""
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        kw: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"DEEPSERVE_KV_{f.name.upper()}")
            if raw is not None:
                kw[f.name] = _parse(f.name, raw, hints[f.name])
        kw.update(overrides)
        return cls(**kw)


def _parse(name: str, raw: str, hint: Any) -> Any:
    """Parse an environment string to the field's type."""
    args = typing.get_args(hint)
    optional = type(None) in args and (typing.get_origin(hint) in (typing.Union, types.UnionType))
    if optional:
        if raw.strip().lower() in ("", "none", "null"):
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if typing.get_origin(hint) is tuple:
            return tuple(s.strip() for s in raw.split(",") if s.strip())
        if hint is bool:
            if raw.strip().lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if hint is int:
            return parse_bytes(raw) if name.endswith("_bytes") else int(raw)
        if hint is float:
            return float(raw)
        return raw
    except ValueError as exc:
        raise KVStoreConfigError(f"DEEPSERVE_KV_{name.upper()}={raw!r}: {exc}") from exc
