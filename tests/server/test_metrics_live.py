"""One scrape of a live ``deepserve up`` covers gateway, router, engine and KV store, with counts
that match the requests made (deltas around a burst of requests, since other tests share the stack)."""

from __future__ import annotations

import re

import httpx
import openai

from tests.server.conftest import E2E_KEY, E2E_MODEL


def _scrape(url: str) -> dict[str, float]:
    """Each sample name with its values summed over all label sets."""
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


def _by_label(url: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_one_scrape_counts_match_requests(live_stack) -> None:
    client = openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_KEY)
    before = _scrape(live_stack.url)
    n, prompt_tokens, completion_tokens = 4, 0, 0
    long_text = " ".join(f"metrics word{j}" for j in range(150))  # > one 128-token unit
    for i in range(n):
        r = client.chat.completions.create(
            model=E2E_MODEL,
            messages=[{"role": "user", "content": f"count {i} " + (long_text if i == 0 else "")}],
            max_tokens=3,
            extra_body={"thinking": {"type": "disabled"}},
        )
        prompt_tokens += r.usage.prompt_tokens
        completion_tokens += r.usage.completion_tokens
    after = _scrape(live_stack.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # gateway
    assert delta("deepserve_http_requests_total") >= n
    assert delta("deepserve_http_request_duration_seconds_count") >= n
    # router
    assert delta("deepserve_router_requests_total") >= n
    assert delta("deepserve_router_decisions_total") >= n
    # engine, merged from the worker process
    assert delta("vllm:e2e_request_latency_seconds_count") == n
    assert delta("vllm:time_to_first_token_seconds_count") == n
    assert delta("vllm:request_queue_time_seconds_count") == n
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") >= completion_tokens  # + the EOS token, if sampled
    assert delta("vllm:prefix_cache_queries_total") >= prompt_tokens
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0
    # histograms are non-empty and sums are positive
    assert after["vllm:e2e_request_latency_seconds_sum"] > before.get("vllm:e2e_request_latency_seconds_sum", 0.0)
    # KV store: the long prompt's whole units were saved
    assert delta("deepserve_kvstore_keys") > 0 and delta("deepserve_kvstore_bytes_used") > 0
    # every worker reports under its own label
    assert _by_label(live_stack.url, "vllm:num_requests_running", "worker")


def test_vllm_parity_metrics(live_stack) -> None:
    client = openai.OpenAI(base_url=live_stack.url + "/v1", api_key=E2E_KEY)
    before = _scrape(live_stack.url)
    steps_before = _by_label(live_stack.url, "deepserve_engine_step_seconds_count", "kind")
    r = client.chat.completions.create(
        model=E2E_MODEL, messages=[{"role": "user", "content": "parity"}], max_tokens=4, n=2, seed=1,
        extra_body={"thinking": {"type": "disabled"}, "ignore_eos": True},
    )
    after = _scrape(live_stack.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:request_prompt_tokens_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == 2 * r.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == r.usage.completion_tokens == 8
    assert delta("vllm:request_params_max_tokens_sum") == 8
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_sum") == 2
    assert delta("vllm:iteration_tokens_total_count") > 0 and delta("vllm:iteration_tokens_total_sum") >= 2 * r.usage.prompt_tokens
    assert delta("vllm:time_per_output_token_seconds_count") == 2 * 3
    # every step that ran tokens is timed, by batch kind: the prompt once, then 3 decode steps
    assert delta("deepserve_engine_step_seconds_count") == delta("vllm:iteration_tokens_total_count")
    steps = _by_label(live_stack.url, "deepserve_engine_step_seconds_count", "kind")
    ran = {k: steps.get(k, 0.0) - steps_before.get(k, 0.0) for k in steps}
    assert ran.get("decode", 0) >= 3 and ran.get("prefill", 0) + ran.get("mixed", 0) >= 1
    for name in ("prefill", "decode", "inference"):
        assert delta(f"vllm:request_{name}_time_seconds_count") == 2
    assert after["vllm:cache_config_info"] >= 1
    assert set(_by_label(live_stack.url, "vllm:num_requests_running", "model_name")) == {E2E_MODEL}  # the served name
    assert set(_by_label(live_stack.url, "vllm:num_requests_running", "engine")) == {"0"}
