"""Engine metrics under the names the inference-gateway ecosystem scrapes (``vllm:*``).

Labels: ``model_name`` (the served name), ``dp_rank`` and vLLM's ``engine`` (the same DP index,
so vLLM dashboards filter as they do there). Per-request histograms are observed when a request
finishes: its prompt and generation tokens, its ``max_tokens``, and the prefill (first scheduled
-> first token), decode (first -> last token) and inference (first scheduled -> finish) times.
``vllm:time_per_output_token_seconds`` is observed per token, as vLLM v1 does (the same values as
``vllm:inter_token_latency_seconds``). ``vllm:cache_config_info`` is 1 with the cache settings as
labels, set at the first step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from engine.runtime.engine_core import EngineCore
    from engine.runtime.sequence import Sequence

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Token-count histograms: 1, 2, 5 x powers of ten up to 1M, as vLLM builds them.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
# Engine step times: 1, 2, 3, 5, 7.5 x powers of ten from 0.1 ms to 10 s.
_STEP_BUCKETS = tuple(m * 10.0**e for e in range(-4, 1) for m in (1, 2, 3, 5, 7.5)) + (10.0,)


class EngineMetricFamilies:
    """The metric families of one worker process (shared by its DP ranks via labels)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "dp_rank", "engine"]
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
        # not a vLLM family: the wall time of one engine step, from scheduling to sampled tokens on
        # the host, by the kind of batch it ran (decode: one new token per row; prefill: no decode
        # row; mixed) -- the figure the bandwidth floor of a decode step is set beside
        self.step_time = Histogram(
            "deepserve_engine_step_seconds", "Wall time of one engine step by batch kind", labels + ["kind"],
            buckets=_STEP_BUCKETS, registry=registry,
        )
        self.preemptions = Counter("vllm:num_preemptions", "Preempted sequences", labels, registry=registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request", labels, buckets=_TOKEN_BUCKETS, registry=registry)
        self.req_generation = Histogram("vllm:request_generation_tokens", "Output tokens per finished request", labels, buckets=_TOKEN_BUCKETS, registry=registry)
        self.req_max_tokens = Histogram("vllm:request_params_max_tokens", "max_tokens of finished requests", labels, buckets=_TOKEN_BUCKETS, registry=registry)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step", labels, buckets=_TOKEN_BUCKETS, registry=registry)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First token to last token", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "First scheduled to finish", labels, buckets=_LATENCY_BUCKETS, registry=registry)
        # speculative decoding (engine/runtime/speculative.py), vLLM's names: verify steps with
        # drafts, drafts verified, drafts accepted, and accepted drafts by draft position
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative verify steps with drafts", labels, registry=registry)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", labels, registry=registry)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=registry)
        self.spec_accepted_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position (0-based)",
            labels + ["position"], registry=registry,
        )
        self.cache_info = Gauge(
            "vllm:cache_config_info", "Cache settings (value 1)",
            ["model_name", "engine", "block_size", "enable_prefix_caching", "state_memory_bytes", "gpu_memory_utilization"],
            registry=registry,
        )


class EngineMetrics:
    """Per-rank view that the engine core calls at its events."""

    def __init__(self, families: EngineMetricFamilies, model_name: str, dp_rank: int) -> None:
        self.f = families
        self.labels = {"model_name": model_name, "dp_rank": str(dp_rank), "engine": str(dp_rank)}
        self._l = lambda m: m.labels(**self.labels)
        self._cache_info_set = False

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self._l(self.f.prompt_tokens).inc(num_prompt_tokens)

    def on_scheduled(self, queue_seconds: float) -> None:
        self._l(self.f.queue).observe(queue_seconds)

    def on_prefix_lookup(self, queried: int, hit: int) -> None:
        self._l(self.f.prefix_queries).inc(queried)
        self._l(self.f.prefix_hits).inc(hit)

    def on_token(self, seq: Sequence, now: float, num_tokens: int = 1) -> None:
        """``num_tokens`` new output tokens of ``seq`` in one step (more than one: speculative)."""
        self._l(self.f.generation_tokens).inc(num_tokens)
        if seq.first_token is None:
            self._l(self.f.ttft).observe(now - seq.arrival)
        elif seq.last_token is not None:
            self._l(self.f.itl).observe(now - seq.last_token)
            self._l(self.f.tpot).observe(now - seq.last_token)

    def on_spec(self, drafted: int, accepted: int) -> None:
        """One verify of ``drafted`` drafts of which the first ``accepted`` were accepted."""
        self._l(self.f.spec_drafts).inc()
        self._l(self.f.spec_draft_tokens).inc(drafted)
        self._l(self.f.spec_accepted).inc(accepted)
        for pos in range(accepted):
            self.f.spec_accepted_pos.labels(**self.labels, position=str(pos)).inc()

    def on_finish(self, seq: Sequence, reason: str) -> None:
        now = time.monotonic()
        self._l(self.f.e2e).observe(now - seq.arrival)
        self.f.finished.labels(**self.labels, finished_reason=reason).inc()
        self._l(self.f.preemptions).inc(seq.num_preemptions)
        self._l(self.f.req_prompt).observe(seq.num_prompt)
        self._l(self.f.req_generation).observe(len(seq.tokens) - seq.num_prompt)
        self._l(self.f.req_max_tokens).observe(seq.request.sampling.max_tokens)
        if seq.first_scheduled is not None:
            self._l(self.f.inference_time).observe(now - seq.first_scheduled)
            if seq.first_token is not None:
                self._l(self.f.prefill_time).observe(seq.first_token - seq.first_scheduled)
        if seq.first_token is not None and seq.last_token is not None:
            self._l(self.f.decode_time).observe(seq.last_token - seq.first_token)

    def on_step(self, core: EngineCore, num_tokens: int = 0, seconds: float = 0.0, kind: str = "") -> None:
        """After a step that ran ``num_tokens`` tokens in ``seconds`` on a ``kind`` batch
        (``decode``, ``prefill`` or ``mixed``; 0 tokens: an idle report)."""
        if not self._cache_info_set:
            self._cache_info_set = True
            c = core.config
            self.f.cache_info.labels(
                model_name=self.labels["model_name"], engine=self.labels["engine"], block_size="128",
                enable_prefix_caching=str(core.kv is not None).lower(), state_memory_bytes=str(c.state_memory_bytes),
                gpu_memory_utilization=str(c.gpu_memory_utilization),
            ).set(1)
        if num_tokens:
            self._l(self.f.iteration_tokens).observe(num_tokens)
            self.f.step_time.labels(**self.labels, kind=kind).observe(seconds)
        self._l(self.f.waiting).set(core.num_waiting)
        self._l(self.f.running).set(core.num_running)
        self._l(self.f.kv_usage).set(core.pool.usage)
