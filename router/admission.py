"""A bounded priority queue for requests that found every eligible rank at its in-flight cap.

Lower ``priority`` values go first (vLLM's convention), then arrival order. Waiters are woken one
at a time (``wake_one``) when capacity may have appeared; a woken waiter that still finds no room
goes back to its old place (``requeue``), and one that is admitted wakes the next, so a freed
slot never wakes the whole queue. Single-threaded (event loop).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from router.errors import Overloaded


class AdmissionQueue:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._heap: list[tuple[int, int, asyncio.Future[bool]]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def enter(self, priority: int, retry_after: float) -> tuple[int, int, asyncio.Future[bool]]:
        """Take a place in the queue; raises ``Overloaded`` when it is full."""
        if len(self._heap) >= self.max_size:
            raise Overloaded(f"admission queue full ({self.max_size} waiting)", retry_after=retry_after)
        entry = (priority, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, entry)
        return entry

    def requeue(self, entry: tuple[int, int, asyncio.Future[bool]]) -> tuple[int, int, asyncio.Future[bool]]:
        """Back to the same place (same priority and sequence number), with a fresh future."""
        fresh = (entry[0], entry[1], asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, fresh)
        return fresh

    def leave(self, entry: tuple[int, int, asyncio.Future[bool]]) -> None:
        """Remove a waiter that gave up (timeout, abort); O(n), rare."""
        try:
            self._heap.remove(entry)
            heapq.heapify(self._heap)
        except ValueError:
            pass

    def wake_one(self) -> None:
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(True)
                return
