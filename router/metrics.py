"""``deepserve_router_*`` Prometheus metrics.

Pass a ``CollectorRegistry`` to put them beside other components' metrics (the gateway does in
``deepserve up``); by default each ``RouterMetrics`` gets a private registry, so several routers in
one process (tests) never collide. Per-token paths touch no metric; per-request paths touch a few
counters and one histogram; load and health gauges are refreshed by the registry's pollers.

The per-request ones (``decisions``, ``requests``, ``added_latency``) are counted in plain Python
numbers and added to their Prometheus metrics when the registry is collected (a collector
registered ahead of them flushes; ``flush()`` does it by hand): a labelled ``inc`` or a histogram
``observe`` takes a lock and cost ~0.5 µs each, three per request.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from router.registry import Worker

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._decisions: dict[tuple[str, str], int] = {}  # counts not yet flushed (see flush)
        self._outcomes: dict[str, int] = {}
        self._lat_counts: list[int] | None = None
        self._lat_sum = 0.0
        r.register(_Flusher(self))  # first, so a scrape flushes before the metrics are read
        self.decisions = Counter("deepserve_router_decisions", "Placement decisions", ["policy", "stage"], registry=r)
        self.requests = Counter("deepserve_router_requests", "Requests by outcome", ["outcome"], registry=r)
        self.retries = Counter("deepserve_router_retries", "Re-dispatches before the first token", ["reason"], registry=r)
        self.migrations = Counter("deepserve_router_migrations", "Re-dispatches after tokens were streamed", registry=r)
        self.disaggregated = Counter("deepserve_router_disaggregated_requests", "Requests sent through the prefill pool", registry=r)
        self.rejected = Counter("deepserve_router_rejected", "Requests refused by admission", ["reason"], registry=r)
        self.added_latency = Histogram(
            "deepserve_router_added_latency_seconds",
            "Router time before a request is sent to its worker (decision, hashing; queueing excluded)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram("deepserve_router_queue_wait_seconds", "Time spent in the admission queue", buckets=_QUEUE_BUCKETS, registry=r)
        self.queue_depth = Gauge("deepserve_router_queue_depth", "Requests waiting for capacity", registry=r)
        self.worker_healthy = Gauge("deepserve_router_worker_healthy", "1 if the worker takes new requests", ["worker_id", "role"], registry=r)
        self.breaker_open = Gauge("deepserve_router_worker_circuit_open", "1 if the worker's circuit breaker is not closed", ["worker_id"], registry=r)
        self.rank_running = Gauge("deepserve_router_rank_running", "Running sequences reported by the rank", ["worker_id", "dp_rank"], registry=r)
        self.rank_waiting = Gauge("deepserve_router_rank_waiting", "Waiting sequences reported by the rank", ["worker_id", "dp_rank"], registry=r)
        self.rank_in_flight = Gauge("deepserve_router_rank_in_flight", "This router's requests on the rank", ["worker_id", "dp_rank"], registry=r)
        self.rank_in_flight_tokens = Gauge("deepserve_router_rank_in_flight_tokens", "Context tokens of this router's requests on the rank", ["worker_id", "dp_rank"], registry=r)
        self._known: dict[str, tuple[str, list[str]]] = {}  # worker_id -> (role, dp ranks) labelled
        self._bounds = list(self.added_latency._upper_bounds)  # ends with +Inf
        self._lat_counts = [0] * len(self._bounds)

    def decision(self, policy: str, stage: str) -> None:
        """Count one placement (this runs per dispatch)."""
        key = (policy, stage)
        self._decisions[key] = self._decisions.get(key, 0) + 1

    def finished(self, outcome: str) -> None:
        """Count one request by how it ended (finish reason, or ``error``)."""
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1

    def observe_added_latency(self, seconds: float) -> None:
        """``added_latency.observe(seconds)``, counted here until the next flush."""
        self._lat_counts[bisect_left(self._bounds, seconds)] += 1
        self._lat_sum += seconds

    def flush(self) -> None:
        """Add the per-request counts kept since the last flush to the Prometheus metrics."""
        decisions, self._decisions = self._decisions, {}
        for (policy, stage), n in decisions.items():
            self.decisions.labels(policy, stage).inc(n)
        outcomes, self._outcomes = self._outcomes, {}
        for outcome, n in outcomes.items():
            self.requests.labels(outcome).inc(n)
        counts, self._lat_counts = self._lat_counts, [0] * len(self._bounds)
        total, self._lat_sum = self._lat_sum, 0.0
        if any(counts):
            h = self.added_latency
            for i, n in enumerate(counts):
                if n:
                    h._buckets[i].inc(n)
            h._sum.inc(total)

    def observe_worker(self, w: Worker) -> None:
        self.worker_healthy.labels(w.worker_id, w.role).set(1.0 if w.available else 0.0)
        self.breaker_open.labels(w.worker_id).set(0.0 if w.breaker.state == "closed" else 1.0)
        ranks = []
        for v in w.ranks:
            r = str(v.dp_rank)
            ranks.append(r)
            self.rank_running.labels(w.worker_id, r).set(v.running)
            self.rank_waiting.labels(w.worker_id, r).set(v.waiting)
            self.rank_in_flight.labels(w.worker_id, r).set(v.in_flight)
            self.rank_in_flight_tokens.labels(w.worker_id, r).set(v.in_flight_tokens)
        self._known[w.worker_id] = (w.role, ranks)

    def forget_worker(self, worker_id: str) -> None:
        role, ranks = self._known.pop(worker_id, ("", []))
        for g, labels in [(self.worker_healthy, (worker_id, role)), (self.breaker_open, (worker_id,))]:
            try:
                g.remove(*labels)
            except KeyError:
                pass
        for g in (self.rank_running, self.rank_waiting, self.rank_in_flight, self.rank_in_flight_tokens):
            for r in ranks:
                try:
                    g.remove(worker_id, r)
                except KeyError:
                    pass

    def render(self) -> bytes:
        return generate_latest(self.registry)  # flushes first (_Flusher)


class _Flusher:
    """A collector that yields nothing: collecting it flushes ``RouterMetrics``' counts."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.metrics.flush()
        return []
