"""``bench.router_inproc`` runs the router's hot route in process and reports CPU per request."""

from __future__ import annotations

import pytest

from bench import router_inproc


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_router_inproc_runs(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert router_inproc.main(["--policy", policy, "--requests", "200", "--repeats", "1", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{policy}: CPU µs/request median ")
