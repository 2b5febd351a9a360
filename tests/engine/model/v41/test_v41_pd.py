"""DeepSeek-V4.1 through the router and real worker processes (tiny-v41, fp32 CPU, a shared
filesystem KV tier): prefill/decode disaggregation gives the colocated tokens and logprobs, and a
decode worker SIGKILLed mid-stream is survived by migration with the undisturbed tokens — the
handoff and the migration move V4.1 KV records (``engine/kv_units_v41.py``) between processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.router import Router
from tests.integration.test_router_real_workers import _config, _requests, _run_all
from tests.integration.workers import start_workers

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def v41_cluster(tmp_path_factory: pytest.TempPathFactory):
    from engine.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-v41-pd") / "model", seed=3, preset="tiny-v41")
    kv, logs = tmp_path_factory.mktemp("kv"), tmp_path_factory.mktemp("logs")
    workers = start_workers(model, kv, ["prefill", "decode", "mixed"], logs)
    yield {"prefill": workers[0], "decode": workers[1], "mixed": workers[2], "kv": kv, "logs": logs, "model": model}
    for w in workers:
        w.terminate()


@pytest.mark.slow  # the default suite pins V4.1 records by test_kv_units_v41 and the worker resume; V4 PD by test_router_real_workers
def test_v41_disaggregated_equals_colocated(v41_cluster) -> None:
    reqs = _requests(4, seed=11, max_tokens=16, lengths=(150, 300, 40, 260))
    c = v41_cluster
    pd = asyncio.run(_run_all(_config(prefill=(c["prefill"].url,), decode=(c["decode"].url,)), reqs))
    co = asyncio.run(_run_all(_config(worker=(c["mixed"].url,)), reqs))
    for (t1, l1, w1), (t2, l2, _) in zip(pd, co):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-4
        assert any(w.startswith("prefill") for w in w1) and any(w.startswith("decode") for w in w1)


@pytest.mark.slow
def test_v41_decode_worker_killed_mid_stream_migrates(v41_cluster) -> None:
    c = v41_cluster
    victim = start_workers(c["model"], c["kv"], ["decode"], c["logs"])[0]
    reqs = _requests(8, seed=12, max_tokens=48, lengths=(140, 60, 200, 90))
    reference = asyncio.run(_run_all(_config(worker=(c["mixed"].url,)), reqs))
    seen: list[str] = []

    async def kill_when_streaming(router: Router) -> None:
        for _ in range(4000):
            if sum(w.startswith("decode-0") for w in seen) >= 3:
                break
            await asyncio.sleep(0.005)
        victim.kill()

    try:
        out = asyncio.run(_run_all(_config(prefill=(c["prefill"].url,), decode=(victim.url, c["decode"].url)), reqs, during=kill_when_streaming, seen=seen))
    finally:
        victim.terminate()
    for (tokens, _, _), (ref, _, _) in zip(out, reference):
        assert tokens == ref
    assert any(any(w.startswith("decode-0") for w in ws) and len(ws) >= 3 for _, _, ws in out), "no stream was migrated"
