"""The soak benchmark (bench/soak_bench.py): how outcomes are judged (pure, cheap), and a short real
soak with every fault (slow: it starts ``deepserve up`` with three workers and valkey)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import soak_bench
from bench.soak_bench import WEIGHTS, Fault, SoakConfig, classify, report
from bench.soak_traffic import Outcome, body_for


def _o(kind: str, status: str, t: float, text: str | None = None, detail: str = "") -> Outcome:
    return Outcome(kind, 0, status, t, t + 1.0, text, detail)  # type: ignore[arg-type]


BASE = {("chat", 0): "abc", ("completion", 0): "xyz"}
FAULTS = [Fault("kill_decode", "decode:1", start=100.0, end=110.0)]


def test_every_kind_has_a_body() -> None:
    for kind in WEIGHTS:
        body = body_for(kind, 1, "m", 8)
        assert isinstance(body, bytes) or json.dumps(body)


@pytest.mark.parametrize("outcome,verdict", [
    (_o("chat", "ok", 0.0, "abc"), ("ok", True)),
    (_o("chat_stream", "ok", 0.0, "abd"), ("ok", False)),  # compared with the plain chat's baseline
    (_o("completion_stream", "ok", 0.0, "xyz"), ("ok", True)),
    (_o("chat", "refused", 105.0, detail="503 unavailable: x"), ("fault_refused", None)),
    (_o("chat", "refused", 124.5, detail="503 unavailable: x"), ("fault_refused", None)),  # within the grace
    (_o("chat", "refused", 200.0, detail="503 unavailable: x"), ("failed", None)),  # no fault then
    (_o("chat", "broken", 105.0, detail="stream ended without [DONE]"), ("failed", None)),  # never excused
    (_o("hostile_pattern", "refused", 5.0, detail="400 invalid_request: x"), ("ok", None)),  # its right answer
    (_o("deep", "refused", 5.0, detail="500 server_error: x"), ("failed", None)),
    (_o("disconnect", "ok", 5.0), ("ok", None)),
])
def test_outcomes_are_judged_against_the_baseline_and_the_fault_windows(outcome: Outcome, verdict: tuple) -> None:
    assert classify(outcome, BASE, FAULTS, grace_s=15.0) == verdict


def test_the_report_adds_up() -> None:
    outs = [_o("chat", "ok", 0.0, "abc"), _o("chat", "ok", 1.0, "zzz"), _o("chat", "refused", 105.0, detail="503 a"),
            _o("chat", "broken", 300.0, detail="cut")]
    samples = [{"t": 0.0, "health": True, "procs": {"gateway": {"rss_mb": 100.0, "fds": 10, "pid": 1}}},
               {"t": 5.0, "health": False, "procs": {"gateway": {"rss_mb": 120.0, "fds": 12, "pid": 1}}}]
    r = report(SoakConfig(), BASE, outs, FAULTS, samples, start=0.0, elapsed=400.0, baseline_s=3.0)
    assert r["totals"] == {"sent": 4, "ok": 2, "fault_refused": 1, "failed": 1, "compared": 2, "wrong_tokens": 1, "broken": 1}
    assert r["rss_mb"]["gateway"] == {"first": 100.0, "last": 120.0, "max": 120.0, "samples": 2}
    assert r["health_not_200_samples"] == 1 and r["faults"][0]["whole_after_s"] == 10.0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_short_soak_with_every_fault(tmp_path: Path, tiny_model_dir: Path) -> None:
    ap = argparse.ArgumentParser()
    soak_bench.add_arguments(ap)
    out = tmp_path / "soak.json"
    args = ap.parse_args(["--duration", "110", "--concurrency", "3", "--fault-every", "22", "--first-fault", "5",
                          "--stop-hold", "6", "--redis-down", "4", "--max-tokens", "8", "--model", str(tiny_model_dir),
                          "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    status = soak_bench.run(args)
    r = json.loads(out.read_text())
    assert [f["name"] for f in r["faults"]][:4] == ["kill_decode", "stop_decode", "redis_down", "kill_prefill"]
    assert r["totals"]["compared"] > 0 and r["totals"]["wrong_tokens"] == 0
    assert r["totals"]["failed"] == 0, r["by_kind"]
    assert status == 0 and r["restarts_logged"] >= 2
