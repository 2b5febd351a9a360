"""``bench.stack_overhead``: the added ITL/TTFT is the median over rounds of each target's
statistic, stack minus direct, and its share of direct; and one short real run (fake worker,
real router and gateway over loopback) answers every request through both targets."""

from __future__ import annotations

import json

from bench.stack_overhead import added, main


def _run(itl_mean: float, ttft_p50: float) -> dict:
    stats = {"mean": itl_mean, "p50": itl_mean, "p90": 2 * itl_mean, "p99": 3 * itl_mean}
    return {"itl_s": stats, "ttft_s": {"mean": ttft_p50, "p50": ttft_p50, "p90": ttft_p50, "p99": ttft_p50}}


def test_added_is_the_difference_of_the_round_medians() -> None:
    stack = [_run(0.0305, 0.060), _run(0.0310, 0.055), _run(0.0900, 0.058)]  # one noisy round
    direct = [_run(0.0300, 0.050), _run(0.0301, 0.051), _run(0.0299, 0.052)]
    a = added(stack, direct)
    assert abs(a["itl_mean"]["added_ms"] - (31.0 - 30.0)) < 1e-9
    assert abs(a["itl_mean"]["share"] - 1.0 / 30.0) < 1e-9
    assert abs(a["itl_p99"]["added_ms"] - 3 * (31.0 - 30.0)) < 1e-9
    assert abs(a["ttft_p50"]["added_ms"] - (58.0 - 51.0)) < 1e-9


def test_a_short_run_streams_through_the_gateway_and_the_router(tmp_path) -> None:
    out = tmp_path / "so.json"
    assert main(["--output", str(out), "--concurrency", "4", "--requests", "8", "--tokens", "6", "--rounds", "1", "--itl", "0.005", "--ttft", "0.01"]) == 0
    res = json.loads(out.read_text())
    for target in ("stack", "direct"):
        (run,) = res["runs"][target]
        assert run["completed"] == 8 and run["failed"] == 0 and run["total_output_tokens"] == 8 * 6
    assert res["runs"]["stack"][0]["cpu_us_per_token"]["gateway"] > 0
