"""Eviction policies order keys; they never touch storage."""

from __future__ import annotations

import pytest

from kvstore.eviction import LFUPolicy, LRUPolicy, make_policy


def test_lru_order() -> None:
    p = LRUPolicy()
    for key in "abcd":
        p.on_insert(key)
    p.on_access("a")
    p.on_insert("b")  # re-insert refreshes
    p.on_remove("c")
    p.on_remove("zz")  # unknown: ignored
    p.on_access("zz")
    assert list(p.victims()) == ["d", "a", "b"] and len(p) == 3


def test_lfu_order_and_ties() -> None:
    p = LFUPolicy()
    for key in "abcd":
        p.on_insert(key)
    for _ in range(3):
        p.on_access("a")
    p.on_access("c")
    # b and d have count 1 (b older), c has 2, a has 4
    assert list(p.victims()) == ["b", "d", "c", "a"]
    p.on_remove("b")
    p.on_remove("a")
    assert list(p.victims()) == ["d", "c"] and len(p) == 2


def test_victims_iteration_allows_removal() -> None:
    for p in (LRUPolicy(), LFUPolicy()):
        for key in "abc":
            p.on_insert(key)
        for key in p.victims():
            p.on_remove(key)
        assert len(p) == 0


def test_registry() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")
