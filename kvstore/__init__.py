"""Content-addressed KV cache store for DeepSeek V4 cache units (DESIGN.md, "KV cache units").

Module map:
- ``keys``: chained hash keys of 128-token units (shared with the router).
- ``record``: block / snapshot records = header + named tensors + crc32 (byte layout inside).
- ``backends/``: one small ``Backend`` interface; memory, host, ssd, redis, fs implementations.
- ``eviction``: LRU / LFU policies, apart from the backends.
- ``tier``: a backend + byte budget + policy + metrics.
- ``store``: ``TieredStore`` (ordered tiers, promotion, write-through/back, events) and
  ``build_store``.
- ``config``: ``KVStoreConfig`` (frozen; ``from_env`` reads ``DEEPSERVE_KV_*``).
- ``registry``: tier name -> backend factory. ``metrics``: ``deepserve_kvstore_*``.
- ``events``: stored/removed ``KVEvent`` ring (per DP rank), its snapshot, subscribers.
"""

import importlib
from typing import Any

# Exports load lazily: ``import kvstore.keys`` (the router's only need) must not pull in torch
# or the redis client.
_EXPORTS = {
    "KVStoreConfig": "kvstore.config",
    "BackendFull": "kvstore.errors",
    "CorruptRecord": "kvstore.errors",
    "InvalidKey": "kvstore.errors",
    "KVStoreConfigError": "kvstore.errors",
    "KVStoreError": "kvstore.errors",
    "EventBatch": "kvstore.events",
    "KVEventLog": "kvstore.events",
    "ROOT_KEY": "kvstore.keys",
    "chain_keys": "kvstore.keys",
    "unit_key": "kvstore.keys",
    "KVStoreMetrics": "kvstore.metrics",
    "FORMAT_VERSION": "kvstore.record",
    "Record": "kvstore.record",
    "RecordHeader": "kvstore.record",
    "decode_record": "kvstore.record",
    "encode_record": "kvstore.record",
    "make_backend": "kvstore.registry",
    "register_backend": "kvstore.registry",
    "TieredStore": "kvstore.store",
    "build_store": "kvstore.store",
    "Tier": "kvstore.tier",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "FORMAT_VERSION",
    "ROOT_KEY",
    "BackendFull",
    "CorruptRecord",
    "EventBatch",
    "InvalidKey",
    "KVEventLog",
    "KVStoreConfig",
    "KVStoreConfigError",
    "KVStoreError",
    "KVStoreMetrics",
    "Record",
    "RecordHeader",
    "Tier",
    "TieredStore",
    "build_store",
    "chain_keys",
    "decode_record",
    "encode_record",
    "make_backend",
    "register_backend",
    "unit_key",
]
