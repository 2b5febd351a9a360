"""Gateway metrics and the merge of the workers' expositions into one valid scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import GatewayMetrics, merge_exposition, route_label

WORKER = """\
# HELP vllm:num_requests_running Running requests
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny",dp_rank="0"} 2.0
# HELP vllm:time_to_first_token_seconds TTFT
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_count{model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_sum{model_name="tiny"} 0.9
# HELP process_cpu_seconds_total CPU
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
# HELP deepserve_http_requests Clash of types
# TYPE deepserve_http_requests gauge
deepserve_http_requests 1.0
"""


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_gateway_metrics_render():
    m = GatewayMetrics(CollectorRegistry())
    m.observe_request("/v1/chat/completions", 200, 0.01)
    m.reject("auth")
    m.by_route["/v1/chat/completions"].streamed.inc(5)
    fams = families(m.render().decode())
    assert fams["deepserve_http_requests"].samples[0].labels == {"route": "/v1/chat/completions", "status": "200"}
    assert any(s.value == 5 for s in fams["deepserve_http_streamed_tokens"].samples)
    assert route_label("/v1/models/abc") == "/v1/models/{id}" and route_label("/x") == "other"


def test_merge_labels_workers_and_merges_families_once():
    reg = CollectorRegistry()
    Counter("process_cpu_seconds", "CPU", registry=reg).inc(1)
    Counter("deepserve_http_requests", "HTTP", ["route"], registry=reg).labels("/h").inc()
    Histogram("deepserve_x_seconds", "x", registry=reg).observe(0.2)
    text = merge_exposition(reg, [("mixed-0", WORKER), ("mixed-1", WORKER), ("broken", "garbage {{{")]).decode()
    assert text.count("# TYPE process_cpu_seconds_total counter") + text.count("# TYPE process_cpu_seconds counter") == 1
    fams = families(text)  # parses: the exposition is valid
    running = fams["vllm:num_requests_running"].samples
    assert {s.labels["worker"] for s in running} == {"mixed-0", "mixed-1"}
    assert all(s.labels["dp_rank"] == "0" for s in running)
    ttft = fams["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram" and len([s for s in ttft.samples if s.name.endswith("_count")]) == 2
    cpu = fams["process_cpu_seconds"].samples
    assert sorted(s.labels.get("worker", "gateway") for s in cpu if s.name.endswith("_total")) == ["gateway", "mixed-0", "mixed-1"]
    http = fams["deepserve_http_requests"]
    assert http.type == "counter" and all("worker" not in s.labels for s in http.samples)  # conflicting type skipped
    assert "deepserve_x_seconds" in fams
