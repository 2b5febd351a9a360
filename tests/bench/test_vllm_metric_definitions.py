"""``deepserve bench serve``'s figures equal what ``vllm bench serve``'s definitions give for the
same run: a synthetic stream of SSE messages with hand-set arrival times goes through our
``Sample.observe`` and ``summarize``; every expected value below was worked out by hand from
vLLM's rules (``bench/client.py`` and ``bench/report.py`` docstrings), not computed by vLLM code."""

from __future__ import annotations

import pytest

from bench.client import Pacing, RunResult, Sample
from bench.report import SLO, summarize

CHOICE = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
EMPTY_CHOICE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}  # a chunk too


def _usage(n: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 99, "completion_tokens": n}}


def _sample(index: int, start: float, expected_input: int, messages: list[tuple[float, dict]], chat: bool = True) -> Sample:
    s = Sample(index, None, expected_input, 0, start=start)
    for t, chunk in messages:
        s.observe(t, chunk, chat)
    return s


def _trace() -> RunResult:
    """Four chat requests over a 2.0 s run; #2 failed."""
    r0 = _sample(0, 0.0, 10, [(0.100, EMPTY_CHOICE), (0.150, CHOICE), (0.210, CHOICE), (0.300, CHOICE), (0.320, _usage(4))])
    r1 = _sample(1, 1.5, 20, [(0.200, CHOICE), (0.260, CHOICE), (0.270, _usage(2))])
    r2 = Sample(2, None, 30, 0, start=0.2, error="http_500")
    r3 = _sample(3, 0.1, 40, [(0.050, CHOICE), (0.055, _usage(1))])
    return RunResult(Pacing(concurrency=4), [r0, r1, r2, r3], duration=2.0, wall_start=0.0)


def test_per_request_ttft_itl_e2el_and_output_len() -> None:
    r0, r1, _, r3 = _trace().samples
    assert r0.ttft == pytest.approx(0.100)  # the role-only first chunk counts: it has choices
    assert r0.itls == pytest.approx([0.050, 0.060, 0.090])
    assert r0.e2e == pytest.approx(0.320)  # chat: the usage chunk's arrival
    assert r0.output_tokens == 4 and r0.tpot == pytest.approx(0.22 / 3)
    assert r1.tpot == pytest.approx(0.07) and r3.tpot is None  # one token: no TPOT


def test_completions_latency_ends_at_the_last_chunk() -> None:
    s = _sample(0, 0.0, 5, [(0.1, {"choices": [{"text": "a"}]}), (0.2, {"choices": [{"text": ""}]}), (0.25, _usage(2))], chat=False)
    assert (s.ttft, s.itls, s.e2e, s.output_tokens) == (pytest.approx(0.1), pytest.approx([0.1]), pytest.approx(0.2), 2)


def test_run_summary_equals_the_hand_computed_vllm_figures() -> None:
    s = summarize(_trace(), SLO.parse(["ttft:150", "tpot:72", "e2el:300"]), percentiles=(99,))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 70 and s["total_output_tokens"] == 7  # dataset lengths; usage counts
    assert s["server_input_tokens"] == 297
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(38.5)
    ttft = s["ttft_s"]  # [0.1, 0.2, 0.05]
    assert ttft["mean"] == pytest.approx(0.35 / 3) and ttft["median"] == pytest.approx(0.1)
    assert ttft["std"] == pytest.approx((0.035 / 9) ** 0.5)  # population std
    assert ttft["p99"] == pytest.approx(0.198)  # 0.1 + 0.98 * (0.2 - 0.1)
    tpot = s["tpot_s"]  # [0.22/3, 0.07]: the one-token request has none
    assert tpot["mean"] == pytest.approx((0.22 / 3 + 0.07) / 2) and tpot["p99"] == pytest.approx(0.07 + 0.99 * (0.22 / 3 - 0.07))
    itl = s["itl_s"]  # [0.05, 0.06, 0.09, 0.06]
    assert itl["mean"] == pytest.approx(0.065) and itl["median"] == pytest.approx(0.06) and itl["p99"] == pytest.approx(0.0891)
    e2el = s["e2e_s"]  # [0.32, 0.27, 0.055]
    assert e2el["mean"] == pytest.approx(0.215) and e2el["median"] == pytest.approx(0.27) and e2el["p99"] == pytest.approx(0.319)
    # goodput: #0 misses TPOT (73.3 > 72 ms), #1 misses TTFT (200 > 150 ms), #3 meets all (its TPOT is 0)
    assert s["goodput"] == pytest.approx(0.5) and s["slo_attainment"] == pytest.approx(0.25)
    # peak: chunks in second 0: 4 (#0) + 1 (#3), second 1: 2 (#1); in flight: 2 in second 0, 1 in second 1
    assert (s["peak_output_throughput"], s["peak_concurrent_requests"]) == (5.0, 2)


def test_an_slo_equal_to_the_value_is_met() -> None:
    s = summarize(_trace(), SLO(ttft=0.05, e2el=0.055))
    assert s["goodput"] == pytest.approx(0.5)  # #3 exactly at both


def test_goodput_spec_is_vllms_form() -> None:
    assert SLO.parse(["ttft:200", "e2el:1500"]) == SLO(ttft=0.2, e2el=1.5)
    for bad in (["ttft=200"], ["itl:5"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)
