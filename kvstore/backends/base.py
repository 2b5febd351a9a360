"""The one storage interface every tier implements: bytes in, bytes out, by string key.

A backend is *mechanism*: it stores and returns opaque values. Budgets, eviction order, record
decoding and metrics live above it (``kvstore.tier``, ``kvstore.store``).

Contract, shared by every backend and checked by one parametrized test:
- ``get`` returns exactly the bytes last ``put`` under the key, or ``None``; never a partial value.
- ``put`` returns ``True`` when the value is stored, ``False`` when the backend is unavailable
  (a remote tier that is down); it raises ``BackendFull`` when there is no room, so the tier can
  evict and retry. Any other storage failure is reported through ``on_error`` and is a no-op.
- ``remove`` returns whether the key was there. Removing a missing key is not an error.
- ``pin``/``unpin`` nest (a count per key); a pinned key is never chosen for eviction. ``remove``
  still removes a pinned key: pins guard against the policy, not against explicit calls.
- Locking: every method may be called from several threads at once.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

log = logging.getLogger(__name__)

ErrorHook = Callable[[str, BaseException], None]  # (operation, exception)


class Backend(ABC):
    """Abstract key -> bytes storage. Subclasses set ``kind`` (the registry name)."""

    kind: str = "abstract"

    def __init__(self) -> None:
        self._pins: dict[str, int] = {}
        self._pin_lock = threading.Lock()
        self.on_error: ErrorHook | None = None  # set by the owning tier to count errors

    # --- single-key operations -------------------------------------------------------------
    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or ``None``."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing any old value); see the module contract."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Delete ``key``; return whether it was there."""

    @abstractmethod
    def entries(self) -> Iterator[tuple[str, int]]:
        """``(key, stored value size in bytes)`` for every stored key, in no particular order."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of values held (this process's view for shared backends)."""

    # --- batched operations (override where one round trip can serve many keys) -------------
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        return [self.put(k, v) for k, v in items]

    def keys(self) -> list[str]:
        return [k for k, _ in self.entries()]

    # --- pins --------------------------------------------------------------------------------
    def pin(self, key: str) -> None:
        """Protect ``key`` from eviction until a matching ``unpin``."""
        with self._pin_lock:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        with self._pin_lock:
            n = self._pins.get(key, 0) - 1
            if n > 0:
                self._pins[key] = n
            else:
                self._pins.pop(key, None)

    def is_pinned(self, key: str) -> bool:
        return key in self._pins

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:  # noqa: B027 - an optional hook, deliberately not abstract
        """Release connections or files; the backend is unusable afterwards."""

    def _report_error(self, op: str, exc: BaseException) -> None:
        if self.on_error is not None:
            try:
                self.on_error(op, exc)
            except Exception:  # a metrics hook must never break storage
                log.exception("kvstore error hook failed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(used_bytes={self.used_bytes()})"
