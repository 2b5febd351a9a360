"""The kvstore package's one exception hierarchy.

Callers above the store (engine, router) only ever see ``KVStoreError`` subclasses, and only from
calls that are about *their* input (a bad config, a malformed key). Storage trouble — a tier that
is down, full or returns damaged bytes — is turned into a miss inside the store, never raised.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error raised by ``kvstore``."""


class CorruptRecord(KVStoreError):
    """Bytes that do not decode to a valid record: bad magic, truncation, checksum mismatch."""


class BackendFull(KVStoreError):
    """A backend has no room for a value (byte budget reached, disk full); the tier evicts."""


class InvalidKey(KVStoreError, ValueError):
    """A key a backend cannot store (empty, or characters unsafe for a file name)."""


class KVStoreConfigError(KVStoreError, ValueError):
    """An invalid ``KVStoreConfig`` (unknown tier, missing directory, bad size)."""
