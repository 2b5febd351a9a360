"""Host memory with a hard byte budget, in (optionally page-locked) torch buffers.

Each value lives in its own ``uint8`` tensor. With ``pin_memory`` (default: when CUDA is present)
the buffers are page-locked, so an engine can copy them to the GPU asynchronously. ``put`` raises
``BackendFull`` when the value would exceed ``capacity_bytes``; the owning tier then evicts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import torch

from kvstore.backends.base import Backend
from kvstore.errors import BackendFull


class HostBackend(Backend):
    """Byte-budgeted host memory pool."""

    kind = "host"

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._data: dict[str, torch.Tensor] = {}  # key -> (nbytes,) uint8
        self._used = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        return key in self._data

    def get(self, key: str) -> bytes | None:
        buf = self._data.get(key)
        return None if buf is None else buf.numpy().tobytes()

    def get_tensor(self, key: str) -> torch.Tensor | None:
        """The stored buffer itself (``(nbytes,) uint8``, pinned when enabled); do not modify it."""
        return self._data.get(key)

    def put(self, key: str, value: bytes) -> bool:
        n = len(value)
        if n > self.capacity_bytes:
            raise BackendFull(f"host pool: value of {n} bytes > capacity {self.capacity_bytes}")
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_memory)  # (n,)
        buf.numpy()[:] = np.frombuffer(value, dtype=np.uint8)  # copy outside the lock
        with self._lock:
            old = self._data.get(key)
            freed = old.numel() if old is not None else 0
            if self._used - freed + n > self.capacity_bytes:
                raise BackendFull(f"host pool: {self._used} + {n} bytes > capacity {self.capacity_bytes}")
            self._data[key] = buf
            self._used += n - freed
        return True

    def remove(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._used -= old.numel()
            return True

    def entries(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            items = [(k, v.numel()) for k, v in self._data.items()]
        return iter(items)

    def used_bytes(self) -> int:
        return self._used
