"""Router + real engine worker processes (tiny model, fp32 CPU, shared filesystem KV tier).

Disaggregated prefill/decode gives the colocated tokens and logprobs; a decode worker killed with
SIGKILL mid-stream is survived by migration with the undisturbed tokens; a dead prefill worker
is retried around; a draining worker finishes its requests, leaves the router service it
registered with and gets no new ones.

A worker process costs seconds of CPU to start (torch, the model, the compiled decode step), so
the module shares one cluster (prefill, decode, mixed) and starts a worker of its own only for a
scenario that ends it (killed, drained) or runs it differently (``--dp 2``).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from deepserve.protocol import GenerateRequest, SamplingParams
from router.config import RouterConfig
from router.router import Router
from tests.integration.workers import AUTH, TOKEN, WorkerProcess, free_port, start_workers

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    logs = tmp_path_factory.mktemp("logs")
    workers = start_workers(tiny_model_dir, kv, ["prefill", "decode", "mixed"], logs)
    yield {"prefill": workers[0], "decode": workers[1:2], "mixed": workers[2], "kv": kv, "logs": logs, "model": tiny_model_dir}
    for w in workers:
        w.terminate()


def _config(**kw) -> RouterConfig:
    base = dict(policy="least_load", load_interval_s=0.1, health_interval_s=0.2, kv_events_interval_s=0.2, backoff_base_s=0.01, pd_min_prompt_tokens=0)
    base.update(kw)
    return RouterConfig(**base)


def _requests(n: int, seed: int, max_tokens: int = 24, lengths=(150, 300, 40, 260)) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        GenerateRequest(
            f"q{seed}-{i}",
            [rng.randrange(2, 129280) for _ in range(lengths[i % len(lengths)])],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
        )
        for i in range(n)
    ]


async def _collect(router: Router, req: GenerateRequest, seen: list[str] | None = None) -> tuple[list[int], list[float], set[str]]:
    """A request's tokens, logprobs and the workers that sent them (``seen``: every token
    event's worker, appended live, for scenarios that act mid-stream)."""
    tokens, lps, workers = [], [], set()
    async for ev in router.generate(GenerateRequest.from_dict(req.to_dict())):
        assert ev.finish_reason != "error", ev.error
        tokens += ev.token_ids
        lps += [lp.logprob for lp in ev.logprobs or []]
        if ev.worker_id:
            workers.add(ev.worker_id)
            if seen is not None and ev.token_ids:
                seen.append(ev.worker_id)
    return tokens, lps, workers


async def _run_all(config: RouterConfig, reqs: list[GenerateRequest], during=None, seen: list[str] | None = None):
    router = Router(config, auth=AUTH)
    await router.start()
    try:
        tasks = [asyncio.create_task(_collect(router, r, seen)) for r in reqs]
        if during is not None:
            await during(router)
        return await asyncio.gather(*tasks)
    finally:
        await router.stop()


def test_disaggregated_equals_colocated(cluster) -> None:
    reqs = _requests(6, seed=1)
    pd = asyncio.run(_run_all(_config(prefill=(cluster["prefill"].url,), decode=tuple(w.url for w in cluster["decode"])), reqs))
    co = asyncio.run(_run_all(_config(worker=(cluster["mixed"].url,)), reqs))
    for (t1, l1, w1), (t2, l2, _) in zip(pd, co):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-4
        assert any(w.startswith("prefill") for w in w1) and any(w.startswith("decode") for w in w1)


def test_prompt_logprobs_cross_the_prefill_decode_split_once(cluster) -> None:
    """The prefill worker scores the prompt; the caller gets those scores once (the decode worker,
    continuing after the first token, computes none), equal to a mixed worker's."""
    rng = random.Random(9)
    req = GenerateRequest("pl", [rng.randrange(2, 129280) for _ in range(200)],
                          SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2))

    async def scores(config: RouterConfig) -> list:
        router = Router(config, auth=AUTH)
        await router.start()
        try:
            return [ev.prompt_logprobs async for ev in router.generate(GenerateRequest.from_dict(req.to_dict())) if ev.prompt_logprobs]
        finally:
            await router.stop()

    pd = asyncio.run(scores(_config(prefill=(cluster["prefill"].url,), decode=tuple(w.url for w in cluster["decode"]))))
    co = asyncio.run(scores(_config(worker=(cluster["mixed"].url,))))
    assert len(pd) == len(co) == 1 and len(pd[0]) == 200 and pd[0][0] is None
    assert max(abs(a.logprob - b.logprob) for a, b in zip(pd[0][1:], co[0][1:])) < 1e-4
    assert [[t for t, _ in a.top] for a in pd[0][1:]] == [[t for t, _ in b.top] for b in co[0][1:]]


def test_decode_worker_killed_mid_stream_migrates(cluster, tmp_path) -> None:
    victim = start_workers(cluster["model"], cluster["kv"], ["decode"], cluster["logs"])[0]
    survivor = cluster["decode"][0]
    reqs = _requests(20, seed=2, max_tokens=60, lengths=(120, 60, 200, 90))
    reference = asyncio.run(_run_all(_config(worker=(cluster["mixed"].url,)), reqs))

    seen: list[str] = []  # worker of every token event, live

    async def kill_when_streaming(router: Router) -> None:
        for _ in range(4000):  # until the victim has streamed tokens to someone
            if sum(w.startswith("decode-0") for w in seen) >= 3:
                break
            await asyncio.sleep(0.005)
        victim.kill()  # 60-token streams: the victim's are mid-stream

    try:
        out = asyncio.run(_run_all(_config(prefill=(cluster["prefill"].url,), decode=(victim.url, survivor.url)), reqs, during=kill_when_streaming, seen=seen))
    finally:
        victim.terminate()
    assert victim.proc.returncode is not None
    for (tokens, _, workers), (ref, _, _) in zip(out, reference):
        assert tokens == ref
    assert any(any(w.startswith("decode-0") for w in ws) and len(ws) >= 3 for _, _, ws in out), "no stream was migrated"


def test_prefill_worker_killed_requests_retried(cluster) -> None:
    # a killed worker's port refuses connections: a port nothing listens on is that worker
    dead_port = free_port()
    reqs = _requests(4, seed=3, max_tokens=8)
    reference = asyncio.run(_run_all(_config(worker=(cluster["mixed"].url,)), reqs))
    out = asyncio.run(_run_all(_config(prefill=(f"http://127.0.0.1:{dead_port}", cluster["prefill"].url), decode=(cluster["decode"][0].url,),
                                       policy="round_robin"), reqs))
    for (tokens, _, workers), (ref, _, _) in zip(out, reference):
        assert tokens == ref
        assert not any(w.endswith(str(dead_port)) for w in workers)


def test_draining_worker_finishes_deregisters_and_gets_no_new_requests(cluster) -> None:
    """``deepserve engine --register ROUTER`` joins a router service (which then serves through it);
    SIGTERM drains it: its running requests finish with the undisturbed tokens, it leaves the router
    service, and a router that still knows it sends it no new requests."""
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    service = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "router", "--port", str(port), "--policy", "least_load", "--internal-token", TOKEN],
                               stdout=open(cluster["logs"] / "router-register.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def listed() -> list[str]:
        return [w["url"] for w in json.load(urllib.request.urlopen(urllib.request.Request(url + "/workers", headers=AUTH.headers())))["workers"]]

    def wait_until(cond, what: str) -> None:
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    first = _requests(4, seed=4, max_tokens=40)
    later = _requests(4, seed=5, max_tokens=6)
    reference = asyncio.run(_run_all(_config(worker=(cluster["mixed"].url,)), first))
    draining: WorkerProcess | None = None
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health")
                break
            except OSError:
                time.sleep(0.1)
        draining = start_workers(cluster["model"], cluster["kv"], ["mixed"], cluster["logs"], extra=("--register", url))[0]
        wait_until(lambda: draining.url in listed(), "worker never registered")
        body = json.dumps(_requests(1, seed=7, max_tokens=4)[0].to_dict()).encode()
        reply = urllib.request.urlopen(urllib.request.Request(url + "/internal/generate", data=body, method="POST", headers=AUTH.headers()), timeout=60).read()
        assert b'"finish_reason"' in reply

        async def scenario():
            router = Router(_config(worker=(draining.url,)), auth=AUTH)
            await router.start()
            try:
                tasks = [asyncio.create_task(_collect(router, r)) for r in first]
                await asyncio.sleep(1.0)
                draining.proc.terminate()  # SIGTERM: drain
                await router.add_worker(cluster["mixed"].url)
                await asyncio.sleep(0.6)
                done = await asyncio.gather(*tasks)
                new = await asyncio.gather(*[_collect(router, r) for r in later])
                return done, new
            finally:
                await router.stop()

        done, new = asyncio.run(scenario())
        wait_until(lambda: draining.url not in listed(), "worker never deregistered")
    finally:
        if draining is not None:
            draining.terminate()
        service.terminate()
        service.wait(10)
    for (tokens, _, workers), (ref, _, _) in zip(done, reference):
        assert tokens == ref
    for _, _, workers in new:
        assert workers and not any(w.endswith(str(draining.port)) for w in workers)


def test_dp_ranks_of_one_worker_share_the_load(cluster) -> None:
    """A ``--dp 2`` worker: the router spreads requests over both ranks and the output is unchanged."""
    import urllib.request

    dp_worker = start_workers(cluster["model"], cluster["kv"], ["mixed"], cluster["logs"], extra=("--dp", "2"))[0]
    try:
        reqs = _requests(6, seed=6, max_tokens=8)
        reference = asyncio.run(_run_all(_config(worker=(cluster["mixed"].url,)), reqs))
        out = asyncio.run(_run_all(_config(worker=(dp_worker.url,)), reqs))
        assert [t for t, _, _ in out] == [t for t, _, _ in reference]
        metrics = urllib.request.urlopen(urllib.request.Request(dp_worker.url + "/metrics", headers=AUTH.headers())).read().decode()
        per_rank = {r: 0.0 for r in ("0", "1")}
        for line in metrics.splitlines():
            if line.startswith("vllm:e2e_request_latency_seconds_count{"):
                rank = line.split('dp_rank="')[1].split('"')[0]
                per_rank[rank] += float(line.rsplit(" ", 1)[1])
        assert per_rank["0"] > 0 and per_rank["1"] > 0 and sum(per_rank.values()) == len(reqs)
    finally:
        dp_worker.terminate()


def test_kv_events_rows_equal_events(cluster) -> None:
    """A real worker answers ``/kv_events?format=rows`` with the events it answers without it,
    as ``KVEvent.to_row`` rows (what the router polls), and a cache-aware router follows them."""
    import json
    import urllib.request

    from deepserve.protocol import KVEvent

    mixed = cluster["mixed"]
    asyncio.run(_run_all(_config(policy="cache_aware", worker=(mixed.url,)), _requests(2, seed=31, max_tokens=2, lengths=(300,))))

    def get(q: str) -> dict:
        with urllib.request.urlopen(urllib.request.Request(mixed.url + "/kv_events?since=0" + q, headers=AUTH.headers()), timeout=10) as r:
            return json.loads(r.read())

    old, new = get(""), get("&format=rows")
    assert old["seq"] == new["seq"] and old["events"] and "events" not in new
    assert [KVEvent.from_row(r) for r in new["rows"]] == [KVEvent.from_dict(e) for e in old["events"]]
    snap = get("&snapshot=1&format=rows")  # what a poller that fell behind rebuilds from
    assert snap["complete"] and snap["seq"] >= new["seq"] and snap["rows"]
    held = {(r[1], r[2], k) for r in snap["rows"] for k in r[3]}
    stored = {(e.dp_rank, e.tier, k) for e in map(KVEvent.from_row, new["rows"]) if e.kind == "stored" for k in e.keys}
    assert held <= stored
