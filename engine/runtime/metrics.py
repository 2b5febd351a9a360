"""Engine metrics under the names the inference-gateway ecosystem scrapes (``vllm:*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from engine.runtime.engine_core import EngineCore
    from engine.runtime.sequence import Sequence

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EngineMetricFamilies:
    """The metric families of one worker process (shared by its DP ranks via labels)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "dp_rank"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of state memory in use (0-1)", labels, registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens received", labels, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens generated", labels, registry=registry)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=registry)
        self.finished = Counter("vllm:request_success", "Finished requests by reason", labels + ["finished_reason"], registry=registry)
        self.preemptions = Counter("vllm:num_preemptions", "Preempted sequences", labels, registry=registry)


class EngineMetrics:
    """Per-rank view that the engine core calls at its events."""

    def __init__(self, families: EngineMetricFamilies, model_name: str, dp_rank: int) -> None:
        self.f = families
        self.labels = {"model_name": model_name, "dp_rank": str(dp_rank)}
        self._l = lambda m: m.labels(**self.labels)

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self._l(self.f.prompt_tokens).inc(num_prompt_tokens)

    def on_scheduled(self, queue_seconds: float) -> None:
        self._l(self.f.queue).observe(queue_seconds)

    def on_prefix_lookup(self, queried: int, hit: int) -> None:
        self._l(self.f.prefix_queries).inc(queried)
        self._l(self.f.prefix_hits).inc(hit)

    def on_token(self, seq: Sequence, now: float) -> None:
        self._l(self.f.generation_tokens).inc()
        if seq.first_token is None:
            self._l(self.f.ttft).observe(now - seq.arrival)
        elif seq.last_token is not None:
            self._l(self.f.itl).observe(now - seq.last_token)

    def on_finish(self, seq: Sequence, reason: str) -> None:
        import time

        self._l(self.f.e2e).observe(time.monotonic() - seq.arrival)
        self.f.finished.labels(**self.labels, finished_reason=reason).inc()
        self._l(self.f.preemptions).inc(seq.num_preemptions)

    def on_step(self, core: EngineCore) -> None:
        self._l(self.f.waiting).set(core.num_waiting)
        self._l(self.f.running).set(core.num_running)
        self._l(self.f.kv_usage).set(core.pool.usage)
