"""Engine-local memory: a dict of immutable ``bytes`` in this process (no budget of its own)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from kvstore.backends.base import Backend


class MemoryBackend(Backend):
    """Values kept as ``bytes`` objects; the tier above enforces any byte budget."""

    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        return key in self._data

    def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def put(self, key: str, value: bytes) -> bool:
        value = bytes(value)  # no copy for bytes; freezes bytearray/memoryview
        with self._lock:
            old = self._data.get(key)
            self._data[key] = value
            self._used += len(value) - (len(old) if old is not None else 0)
        return True

    def remove(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._used -= len(old)
            return True

    def entries(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            items = [(k, len(v)) for k, v in self._data.items()]
        return iter(items)

    def used_bytes(self) -> int:
        return self._used
