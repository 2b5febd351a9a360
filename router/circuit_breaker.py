"""A per-worker circuit breaker fed by request outcomes.

::

    closed --(failure_threshold consecutive failures)--> open
    open   --(cooldown_s elapsed)-----------------------> half_open
    half_open --(a probe succeeds)----------------------> closed
    half_open --(a probe fails)-------------------------> open (cooldown doubles, up to max)

While open the worker gets no requests; half-open lets ``half_open_probes`` requests through at
a time to test it. A probe can end with no verdict (the client left, the worker refused it as a
client error): its slot is free again ``cooldown_s`` after it was sent, so such a probe never
keeps a recovered worker out for good. Active health checks are separate (``registry``): the breaker only reacts to
what real requests experience, so a worker that answers ``/health`` but fails requests is still
taken out. Single-threaded (event loop); ``clock`` is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        *,
        max_cooldown_s: float = 60.0,
        half_open_probes: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert failure_threshold >= 1 and cooldown_s >= 0 and half_open_probes >= 1
        self.failure_threshold = failure_threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max(max_cooldown_s, cooldown_s)
        self.half_open_probes = half_open_probes
        self._clock = clock
        self._state: BreakerState = "closed"
        self._failures = 0  # consecutive, while closed
        self._opened_at = 0.0
        self._cooldown_s = cooldown_s
        self._probes = 0  # in flight, while half-open
        self._probe_at = 0.0  # when the last probe was sent

    @property
    def state(self) -> BreakerState:
        now = self._clock()
        if self._state == "open" and now - self._opened_at >= self._cooldown_s:
            self._state = "half_open"
            self._probes = 0
        elif self._state == "half_open" and self._probes and now - self._probe_at >= self._cooldown_s:
            self._probes = 0  # the probes out that long ended without a verdict: probe again
        return self._state

    @property
    def available(self) -> bool:
        """May a request be sent now? (Does not reserve a half-open probe; ``on_dispatch`` does.)"""
        s = self.state
        return s == "closed" or (s == "half_open" and self._probes < self.half_open_probes)

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self._probes += 1
            self._probe_at = self._clock()

    def record_success(self) -> None:
        if self._state != "closed":
            self._state = "closed"
            self._cooldown_s = self.base_cooldown_s
        self._failures = 0
        self._probes = 0

    def record_failure(self) -> None:
        s = self.state
        if s == "half_open":
            self._cooldown_s = min(self._cooldown_s * 2, self.max_cooldown_s)
            self._open()
        elif s == "closed":
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open()

    def trip(self) -> None:
        """Open now (e.g. the worker's port refused a connection: it is down, not flaky)."""
        if self.state != "open":
            self._open()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = self._clock()
        self._failures = 0
        self._probes = 0
