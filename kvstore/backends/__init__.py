"""Storage backends: one small interface (``base.Backend``), one file per kind of storage."""

from kvstore.backends.base import Backend
from kvstore.backends.fs import FSBackend
from kvstore.backends.host import HostBackend
from kvstore.backends.memory import MemoryBackend
from kvstore.backends.redis import RedisBackend
from kvstore.backends.ssd import SSDBackend

__all__ = ["Backend", "FSBackend", "HostBackend", "MemoryBackend", "RedisBackend", "SSDBackend"]
