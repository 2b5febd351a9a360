"""Authenticated values on a shared tier: an HMAC-SHA256 tag over (key, value) on every record.

A shared tier (Redis, a shared filesystem) can be written by anything that reaches it; a record
there decides the logits of every request that hits it. With a key known to the workers only
(``KVStoreConfig.hmac_key_file``), ``SealedBackend`` stores ``value || tag`` in the backend it
wraps, ``tag = HMAC-SHA256(secret, key || 0x00 || value)``, and returns only values whose tag
verifies: a forged, altered or moved (stored under another key) record is a miss, counted as
``corrupt``. The tag is bound to the key, so a valid record copied under another key fails too.
Sizes reported by ``entries``/``used_bytes`` include the 32 tag bytes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator, Sequence

from kvstore.backends.base import Backend

TAG_BYTES = 32


class SealedBackend(Backend):
    """``inner`` with every value tagged on ``put`` and checked on ``get`` (module docstring)."""

    def __init__(self, inner: Backend, secret: bytes) -> None:
        super().__init__()
        if len(secret) < 16:
            raise ValueError("the KV HMAC key must be at least 16 bytes")
        self.inner = inner
        self.kind = inner.kind  # the tier it is, for metrics and the registry
        self._secret = secret
        inner.on_error = self._report_error

    def _tag(self, key: str, value: bytes | memoryview) -> bytes:
        mac = hmac.new(self._secret, key.encode() + b"\0", hashlib.sha256)
        mac.update(value)
        return mac.digest()

    def _seal(self, key: str, value: bytes) -> bytes:
        return value + self._tag(key, value)

    def _open(self, key: str, stored: bytes | None) -> bytes | None:
        if stored is None:
            return None
        view = memoryview(stored)
        if len(stored) >= TAG_BYTES and hmac.compare_digest(self._tag(key, view[:-TAG_BYTES]), view[-TAG_BYTES:]):
            return stored[:-TAG_BYTES]
        self._report_error("corrupt", ValueError(f"record {key} failed its HMAC check"))
        return None

    # --- the interface, delegated ---------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def get(self, key: str) -> bytes | None:
        return self._open(key, self.inner.get(key))

    def put(self, key: str, value: bytes) -> bool:
        return self.inner.put(key, self._seal(key, value))

    def remove(self, key: str) -> bool:
        return self.inner.remove(key)

    def entries(self) -> Iterator[tuple[str, int]]:
        return self.inner.entries()

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(keys)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._open(k, v) for k, v in zip(keys, self.inner.get_many(keys))]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return self.inner.put_many([(k, self._seal(k, v)) for k, v in items])

    def pin(self, key: str) -> None:
        self.inner.pin(key)

    def unpin(self, key: str) -> None:
        self.inner.unpin(key)

    def is_pinned(self, key: str) -> bool:
        return self.inner.is_pinned(key)

    def close(self) -> None:
        self.inner.close()
