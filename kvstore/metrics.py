"""Prometheus metrics of the KV store, one label ``tier`` (memory, host, ssd, redis, fs).

Names (counters get ``_total`` appended by prometheus-client)::

    deepserve_kvstore_bytes_used{tier}               gauge: bytes of values held
    deepserve_kvstore_keys{tier}                     gauge: keys the tier's policy tracks
    deepserve_kvstore_hits_total{tier}               reads answered with a valid record
    deepserve_kvstore_misses_total{tier}             reads that found nothing usable
    deepserve_kvstore_evictions_total{tier}          keys evicted for room
    deepserve_kvstore_errors_total{tier,op}          backend failures (down, timeout, I/O)
    deepserve_kvstore_corrupt_records_total{tier}    records failing magic/length/checksum
    deepserve_kvstore_rejected_puts_total{tier}      puts dropped: no room even after eviction
    deepserve_kvstore_get_seconds{tier}              histogram of backend get latency
    deepserve_kvstore_put_seconds{tier}              histogram of backend put latency
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


def _metric(registry: CollectorRegistry, cls: type, name: str, doc: str, labels: tuple[str, ...], **kw: Any) -> Any:
    """Create a metric, or return the one already registered under ``name``.

    Several stores in one process (tests, a worker with two DP ranks) share the global registry;
    prometheus-client refuses a second registration, so reuse the first collector.
    """
    try:
        return cls(name, doc, labels, registry=registry, **kw)
    except ValueError:
        existing = registry._names_to_collectors.get(name)  # noqa: SLF001 - no public lookup exists
        if existing is None:
            raise
        return existing


class KVStoreMetrics:
    """The store's metrics; ``registry=None`` uses prometheus-client's global registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = REGISTRY if registry is None else registry
        t = ("tier",)
        self.bytes_used = _metric(r, Gauge, "deepserve_kvstore_bytes_used", "Bytes of values held per tier", t)
        self.keys = _metric(r, Gauge, "deepserve_kvstore_keys", "Keys tracked per tier", t)
        self.hits = _metric(r, Counter, "deepserve_kvstore_hits", "Reads answered with a valid record", t)
        self.misses = _metric(r, Counter, "deepserve_kvstore_misses", "Reads that found nothing usable", t)
        self.evictions = _metric(r, Counter, "deepserve_kvstore_evictions", "Keys evicted to make room", t)
        self.errors = _metric(r, Counter, "deepserve_kvstore_errors", "Backend failures", ("tier", "op"))
        self.corrupt = _metric(r, Counter, "deepserve_kvstore_corrupt_records", "Records failing verification", t)
        self.rejected = _metric(r, Counter, "deepserve_kvstore_rejected_puts", "Puts dropped for lack of room", t)
        self.get_seconds = _metric(
            r, Histogram, "deepserve_kvstore_get_seconds", "Backend get latency", t, buckets=_LATENCY_BUCKETS
        )
        self.put_seconds = _metric(
            r, Histogram, "deepserve_kvstore_put_seconds", "Backend put latency", t, buckets=_LATENCY_BUCKETS
        )
