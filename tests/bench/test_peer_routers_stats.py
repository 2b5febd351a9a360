"""bench.peer_routers summaries: medians, quartiles and per-round ratios (no processes started)."""

from bench.peer_routers import Pinning, Result, _cpu_set, _quartiles, stats, stats_markdown


def _res(router: str, policy: str, rnd: int, rps: float, cpu: float, ttft: float = 0.001, scenario: str = "throughput") -> Result:
    return Result(scenario, router, policy, {"request_throughput": rps, "cpu_us_per_req": {"router": cpu}, "ttft_s": {"p50": ttft}}, [], rnd)


def test_quartiles_and_cpu_sets():
    assert _quartiles([4, 1, 3, 2]) == (1.75, 2.5, 3.25)
    assert _quartiles([5]) == (5, 5, 5)
    assert _cpu_set("0,2-3") == {0, 2, 3}
    assert Pinning(router="1").wrap(["x"], "1") == ["taskset", "-c", "1", "x"] and Pinning().wrap(["x"], None) == ["x"]


def test_ratios_pair_runs_of_the_same_round():
    results = [
        _res("vllm-router", "round_robin", 0, 1000, 100),
        _res("deepserve", "cache_aware", 0, 900, 120),
        _res("vllm-router", "round_robin", 1, 2000, 50),
        # round 1 of deepserve failed; round 2 has no reference run
        _res("deepserve", "cache_aware", 2, 800, 110),
    ]
    rows = {(r["router"], r["policy"]): r for r in stats(results)}
    ours = rows[("deepserve", "cache_aware")]
    assert ours["rounds"] == 2 and ours["req_per_s_vs_ref"] == [0.9] and ours["cpu_vs_ref"] == [1.2]
    assert rows[("vllm-router", "round_robin")]["cpu_vs_ref"] == [1.0, 1.0]
    table = stats_markdown(list(rows.values()))
    assert "| throughput | deepserve | cache_aware | 2 | 115 [112–118] | 1.20 |" in table


def test_added_ttft_against_direct_of_the_same_round():
    results = [
        _res("direct", "round_robin", 0, 300, 0, 0.0050, "latency"),
        _res("deepserve", "round_robin", 0, 300, 600, 0.0053, "latency"),
        _res("direct", "round_robin", 1, 300, 0, 0.0060, "latency"),
        _res("deepserve", "round_robin", 1, 300, 600, 0.0061, "latency"),
    ]
    rows = {r["router"]: r for r in stats(results)}
    assert [round(x * 1e3, 3) for x in rows["deepserve"]["added_ttft_p50_s"]] == [0.3, 0.1]
    assert rows["direct"]["added_ttft_p50_s"] == [] and rows["direct"]["cpu_us_per_req"] == []
