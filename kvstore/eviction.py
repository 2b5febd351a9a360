"""Eviction policies: which key a budgeted tier gives up first (policy, apart from the backends).

A policy only orders keys; it never touches storage. The tier tells it what was inserted,
accessed and removed, and asks for ``victims()`` (coldest first) when it needs room; the tier
skips pinned keys and removes the rest from its backend. Policies are not thread-safe on their
own: the owning tier calls them under its lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator


class EvictionPolicy(ABC):
    """Orders the keys of one tier for eviction."""

    @abstractmethod
    def on_insert(self, key: str) -> None:
        """``key`` was stored (or stored again)."""

    @abstractmethod
    def on_access(self, key: str) -> None:
        """``key`` was read."""

    @abstractmethod
    def on_remove(self, key: str) -> None:
        """``key`` left the tier (removed or evicted); unknown keys are ignored."""

    @abstractmethod
    def victims(self) -> Iterator[str]:
        """Tracked keys, the one to evict first first. Callers may remove keys while iterating."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used (insert or read) first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest first

    def on_insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy(EvictionPolicy):
    """Least frequently used first; ties broken by least recent use.

    Keys live in frequency buckets (count -> keys in LRU order), so an access is O(1) and finding
    victims walks the few distinct counts in increasing order.
    """

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._buckets: dict[int, OrderedDict[str, None]] = {}

    def _move(self, key: str, new: int) -> None:
        old = self._count.get(key)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]
        self._count[key] = new
        self._buckets.setdefault(new, OrderedDict())[key] = None

    def on_insert(self, key: str) -> None:
        self._move(key, self._count.get(key, 0) + 1)

    def on_access(self, key: str) -> None:
        if key in self._count:
            self._move(key, self._count[key] + 1)

    def on_remove(self, key: str) -> None:
        old = self._count.pop(key, None)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]

    def victims(self) -> Iterator[str]:
        order = [k for c in sorted(self._buckets) for k in self._buckets[c]]
        return iter(order)

    def __len__(self) -> int:
        return len(self._count)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by registry name (``"lru"``, ``"lfu"``)."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None
