"""What the deployment files may rely on: the CLI's sub-commands and the metric families.

This is the contract between ``deploy/`` (and ``docker-compose.yml``) and the code. The tests
check the deployment files against it statically, and, where a component's code already exists,
check the contract against the code too (so a renamed flag or metric fails here, not in a
dashboard that silently shows nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]

# `deepserve <sub-command>`s (DESIGN.md, "CLI").
SUBCOMMANDS = frozenset({"up", "gateway", "router", "engine", "make-tiny-model", "make-internal-token", "generate", "bench", "simulate"})
# Sub-commands that run an HTTP server with /health and /metrics.
SERVING_SUBCOMMANDS = frozenset({"up", "gateway", "router", "engine"})
ROLES = frozenset({"prefill", "decode", "mixed"})

MetricType = Literal["counter", "gauge", "histogram"]

# Metric families as registered (prometheus-client appends ``_total`` to counters on exposition).
# Owner = the package whose source defines them.
METRICS: dict[str, tuple[MetricType, str]] = {
    # engine workers, labelled model_name and dp_rank (names the vLLM ecosystem already scrapes)
    "vllm:num_requests_waiting": ("gauge", "engine"),
    "vllm:num_requests_running": ("gauge", "engine"),
    "vllm:kv_cache_usage_perc": ("gauge", "engine"),
    "vllm:time_to_first_token_seconds": ("histogram", "engine"),
    "vllm:inter_token_latency_seconds": ("histogram", "engine"),
    "vllm:e2e_request_latency_seconds": ("histogram", "engine"),
    "vllm:request_queue_time_seconds": ("histogram", "engine"),
    "vllm:prompt_tokens": ("counter", "engine"),
    "vllm:generation_tokens": ("counter", "engine"),
    "vllm:prefix_cache_queries": ("counter", "engine"),
    "vllm:prefix_cache_hits": ("counter", "engine"),
    "vllm:request_success": ("counter", "engine"),  # label finished_reason
    "vllm:num_preemptions": ("counter", "engine"),
    # gateway (server/metrics.py)
    "deepserve_http_requests": ("counter", "server"),
    "deepserve_http_request_duration_seconds": ("histogram", "server"),
    "deepserve_http_time_to_first_token_seconds": ("histogram", "server"),
    "deepserve_http_streamed_tokens": ("counter", "server"),
    "deepserve_http_prompt_tokens": ("counter", "server"),
    "deepserve_http_completion_tokens": ("counter", "server"),
    "deepserve_http_active_streams": ("gauge", "server"),
    "deepserve_http_requests_running": ("gauge", "server"),
    "deepserve_http_requests_queued": ("gauge", "server"),
    "deepserve_http_rejected": ("counter", "server"),
    # router (router/metrics.py)
    "deepserve_router_decisions": ("counter", "router"),
    "deepserve_router_requests": ("counter", "router"),
    "deepserve_router_retries": ("counter", "router"),
    "deepserve_router_migrations": ("counter", "router"),
    "deepserve_router_disaggregated_requests": ("counter", "router"),
    "deepserve_router_rejected": ("counter", "router"),
    "deepserve_router_added_latency_seconds": ("histogram", "router"),
    "deepserve_router_queue_wait_seconds": ("histogram", "router"),
    "deepserve_router_queue_depth": ("gauge", "router"),
    "deepserve_router_worker_healthy": ("gauge", "router"),
    "deepserve_router_worker_circuit_open": ("gauge", "router"),
    "deepserve_router_rank_running": ("gauge", "router"),
    "deepserve_router_rank_waiting": ("gauge", "router"),
    "deepserve_router_rank_in_flight": ("gauge", "router"),
    "deepserve_router_rank_in_flight_tokens": ("gauge", "router"),
    # KV store, label tier (kvstore/metrics.py)
    "deepserve_kvstore_bytes_used": ("gauge", "kvstore"),
    "deepserve_kvstore_keys": ("gauge", "kvstore"),
    "deepserve_kvstore_hits": ("counter", "kvstore"),
    "deepserve_kvstore_misses": ("counter", "kvstore"),
    "deepserve_kvstore_evictions": ("counter", "kvstore"),
    "deepserve_kvstore_errors": ("counter", "kvstore"),
    "deepserve_kvstore_corrupt_records": ("counter", "kvstore"),
    "deepserve_kvstore_rejected_puts": ("counter", "kvstore"),
    "deepserve_kvstore_get_seconds": ("histogram", "kvstore"),
    "deepserve_kvstore_put_seconds": ("histogram", "kvstore"),
}


def family_of(family: str) -> str:
    """Registered name without a counter's ``_total`` (prometheus-client accepts both spellings)."""
    return family.removesuffix("_total")


def exposed_series() -> dict[str, tuple[str, MetricType]]:
    """Every series name a scrape can show -> (family, type): ``_total``, ``_bucket`` and so on."""
    out: dict[str, tuple[str, MetricType]] = {}
    for family, (kind, _owner) in METRICS.items():
        base = family_of(family)
        if kind == "counter":
            names = [base + "_total", base + "_created"]
        elif kind == "histogram":
            names = [base + s for s in ("_bucket", "_sum", "_count", "_created")]
        else:
            names = [base]
        for n in names:
            out[n] = (family, kind)
    return out
