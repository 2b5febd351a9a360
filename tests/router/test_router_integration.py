"""The Router against FAKE worker processes on loopback (tests/router/fake_worker.py)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from deepserve.protocol import GenerateRequest, SamplingParams
from router.config import RouterConfig
from router.errors import NoWorkerAvailable, Overloaded
from router.router import Router
from router.service import RouterService
from router.serving import SERVERS
from router.worker_client import WorkerClient
from tests.router.fake_worker import expected_tokens


def config(**kw) -> RouterConfig:
    base = dict(policy="least_load", load_interval_s=0.1, health_interval_s=0.2, kv_events_interval_s=0.1, backoff_base_s=0.005, pd_min_prompt_tokens=512)
    base.update(kw)
    return RouterConfig(**base)


def request(i: int, prompt_len: int = 64, max_tokens: int = 20, **kw) -> GenerateRequest:
    prompt = [(i * 7919 + j * 31) % 30000 for j in range(prompt_len)]
    return GenerateRequest(request_id=f"req-{i}", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), **kw)


async def collect(router: Router, req: GenerateRequest) -> tuple[list[int], list]:
    """``req``'s tokens and events."""
    tokens, events = [], []
    async for ev in router.generate(req):
        tokens.extend(ev.token_ids)
        events.append(ev)
    return tokens, events


def expected(req: GenerateRequest) -> list[int]:
    return expected_tokens(req.prompt_token_ids, req.sampling.max_tokens, req.sampling.stop_token_ids)


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def stats(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/fake/stats") as r:
        return await r.json()


async def control(url: str, **body) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/fake/control", json=body) as r:
        assert r.status == 200


def GenerateRequestBody(req: GenerateRequest) -> bytes:
    return json.dumps(req.to_dict()).encode()


async def until_async(fetch, cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond(await fetch()):
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streams_exact_tokens_over_dp_ranks(spawn):
    w = spawn("--worker-id", "w", "--dp", "2", "--token-delay", "0.002")

    async def main():
        async with Router(config(worker=(w.url,))) as r:
            reqs = [request(i) for i in range(8)]
            results = await asyncio.gather(*(collect(r, q) for q in reqs))
            for q, (toks, events) in zip(reqs, results):
                assert toks == expected(q)
                assert events[-1].finish_reason == "length" and events[0].num_prompt_tokens == 64
            s = await stats(w.url)
            assert s["rank0"] >= 3 and s["rank1"] >= 3  # both DP ranks used
            assert r.num_in_flight == 0 and all(v.in_flight == v.in_flight_tokens == 0 for v in r.registry.workers()[0].ranks)

    asyncio.run(main())


def test_retry_when_a_worker_refuses(spawn):
    bad = spawn("--worker-id", "bad", "--refuse", "-1")
    good = spawn("--worker-id", "good")

    async def main():
        async with Router(config(policy="round_robin", worker=(bad.url, good.url))) as r:
            reqs = [request(i) for i in range(6)]
            results = await asyncio.gather(*(collect(r, q) for q in reqs))
            assert all(toks == expected(q) for q, (toks, _) in zip(reqs, results))
            assert r.metrics.retries.labels("failure")._value.get() >= 1
            assert r.registry.get("bad").breaker.state != "closed"  # 3 failures opened it
            assert (await stats(bad.url))["refused"] >= 1

    asyncio.run(main())


def test_retry_when_a_worker_is_down_before_the_router_noticed(spawn):
    a = spawn("--worker-id", "a")
    b = spawn("--worker-id", "b")

    async def main():
        async with Router(config(policy="round_robin", worker=(a.url, b.url), load_interval_s=30.0)) as r:
            a.kill9()  # the registry still believes it alive: requests meet a refused connection
            reqs = [request(i) for i in range(4)]
            results = await asyncio.gather(*(collect(r, q) for q in reqs))
            assert all(toks == expected(q) for q, (toks, _) in zip(reqs, results))
            assert r.metrics.retries.labels("connect")._value.get() >= 1
            assert not r.registry.get("a").available

    asyncio.run(main())


@pytest.mark.parametrize("disaggregated", [False, True])
def test_migration_when_a_decode_worker_is_killed_mid_stream(spawn, disaggregated):
    decode = [spawn("--worker-id", f"d{i}", "--role", "decode", "--token-delay", "0.01") for i in range(3)]
    prefill = [spawn("--worker-id", "p", "--role", "prefill")] if disaggregated else []
    prompt_len = 600 if disaggregated else 64  # >= pd_min_prompt_tokens: through the prefill pool

    async def main():
        async with Router(config(decode=tuple(w.url for w in decode), prefill=tuple(w.url for w in prefill))) as r:
            reqs = [request(i, prompt_len=prompt_len, max_tokens=40) for i in range(20)]
            tasks = [asyncio.create_task(collect(r, q)) for q in reqs]
            dec = [w for w in r.registry.workers() if w.role == "decode"]
            await until(lambda: sum(v.in_flight_tokens for w in dec for v in w.ranks) >= 20 * (prompt_len + 8))
            victim = max(dec, key=lambda w: w.in_flight)
            assert victim.in_flight > 0
            next(w for w in decode if w.url == victim.url).kill9()
            results = await asyncio.gather(*tasks)
            for q, (toks, events) in zip(reqs, results):
                assert toks == expected(q), q.request_id  # complete, no gap, no repeat
                assert events[-1].finish_reason == "length"
            assert r.metrics.migrations._value.get() >= 1
            if disaggregated:
                assert (await stats(prefill[0].url))["prefill_only"] == 20

    asyncio.run(main())


def test_disaggregated_equals_colocated_and_short_prompts_skip_prefill(spawn):
    p = spawn("--worker-id", "p", "--role", "prefill")
    d = spawn("--worker-id", "d", "--role", "decode")

    async def main():
        async with Router(config(prefill=(p.url,), decode=(d.url,))) as r:
            long_reqs = [request(i, prompt_len=600) for i in range(4)]
            for q in long_reqs:
                toks, events = await collect(r, q)
                assert toks == expected(q)
                assert events[0].token_ids == toks[:1] and events[0].finish_reason is None  # first token first
                assert all(e.num_prompt_tokens in (0, 600) for e in events)
            toks, _ = await collect(r, request(10, prompt_len=100))
            assert toks == expected(request(10, prompt_len=100))
            one = request(11, prompt_len=600, max_tokens=1)  # done after the prefill stage
            toks, events = await collect(r, one)
            assert toks == expected(one) and events[-1].finish_reason == "length"
            ps, ds = await stats(p.url), await stats(d.url)
            assert ps["prefill_only"] == 5 and ds["continued"] == 4 and ds["fresh"] == 1
            assert r.metrics.disaggregated._value.get() == 5

    asyncio.run(main())


def test_prefill_worker_killed_requests_retried_elsewhere(spawn):
    p1 = spawn("--worker-id", "p1", "--role", "prefill")
    p2 = spawn("--worker-id", "p2", "--role", "prefill")
    d = spawn("--worker-id", "d", "--role", "decode")

    async def main():
        async with Router(config(policy="round_robin", prefill=(p1.url, p2.url), decode=(d.url,), load_interval_s=30.0)) as r:
            p1.kill9()
            reqs = [request(i, prompt_len=700) for i in range(4)]
            results = await asyncio.gather(*(collect(r, q) for q in reqs))
            assert all(toks == expected(q) for q, (toks, _) in zip(reqs, results))
            assert (await stats(p2.url))["prefill_only"] == 4
            p2.kill9()  # no prefill worker left: colocated on the decode pool
            q = request(9, prompt_len=700)
            assert (await collect(r, q))[0] == expected(q)

    asyncio.run(main())


def test_drained_worker_finishes_its_requests_and_gets_no_new_ones(spawn):
    a = spawn("--worker-id", "a", "--token-delay", "0.01")
    b = spawn("--worker-id", "b", "--token-delay", "0.001")

    async def main():
        async with Router(config(policy="round_robin", worker=(a.url, b.url))) as r:
            running = [asyncio.create_task(collect(r, request(i, max_tokens=30))) for i in range(4)]
            await until(lambda: r.registry.get("a").in_flight > 0)
            r.drain("a")
            before = (await stats(a.url))["requests"]
            later = [request(100 + i) for i in range(6)]
            results = await asyncio.gather(*(collect(r, q) for q in later))
            assert all(toks == expected(q) for q, (toks, _) in zip(later, results))
            for i, t in enumerate(running):  # the drained worker's requests completed
                assert (await t)[0] == expected(request(i, max_tokens=30))
            assert (await stats(a.url))["requests"] == before
            # the worker itself says it drains (/health 503, /load draining)
            r.drain("a", False)
            await control(b.url, draining=True)
            await until(lambda: not r.registry.get("b").available)
            before_b = (await stats(b.url))["requests"]
            await asyncio.gather(*(collect(r, request(200 + i)) for i in range(4)))
            assert (await stats(b.url))["requests"] == before_b

    asyncio.run(main())


def test_abort_and_disconnect_propagate_to_the_worker(spawn):
    w = spawn("--worker-id", "w", "--token-delay", "0.02")

    async def main():
        async with Router(config(worker=(w.url,))) as r:
            q = request(1, max_tokens=200)
            seen = []
            async for ev in r.generate(q):
                seen.append(ev)
                if len(seen) == 2:
                    assert await r.abort(q.request_id)
            assert seen[-1].finish_reason == "abort" and len(seen) < 20
            gen = r.generate(request(2, max_tokens=200))  # a client that goes away
            await anext(gen)
            await gen.aclose()
            await until(lambda: r.num_in_flight == 0)
            await asyncio.sleep(0.2)
            s = await stats(w.url)
            assert s["abort_calls"] >= 2 and s["aborted"] >= 1

    asyncio.run(main())


def test_overload_queue_with_priorities(spawn):
    w = spawn("--worker-id", "w", "--token-delay", "0.01")

    async def main():
        async with Router(config(worker=(w.url,), max_inflight_per_rank=1, max_queue=2)) as r:
            first = asyncio.create_task(collect(r, request(0, max_tokens=10)))
            await until(lambda: r.num_in_flight == 1)
            order: list[str] = []

            async def tracked(q):
                toks, _ = await collect(r, q)
                order.append(q.request_id)
                return toks

            low = asyncio.create_task(tracked(request(1, max_tokens=5, priority=5)))
            high = asyncio.create_task(tracked(request(2, max_tokens=5, priority=-1)))
            await until(lambda: len(r._queue) == 2)
            with pytest.raises(Overloaded) as exc:
                await collect(r, request(3))
            assert exc.value.retry_after > 0
            await asyncio.gather(first, low, high)
            assert order == ["req-2", "req-1"]  # lower priority value first
            assert r.metrics.rejected.labels("no_worker")._value.get() == 0

    asyncio.run(main())


def test_no_worker_available(spawn):
    async def main():
        async with Router(config(worker=(f"http://127.0.0.1:{free_port()}",))) as r:
            assert not r.healthy()
            with pytest.raises(NoWorkerAvailable):
                await collect(r, request(0))

    asyncio.run(main())


@pytest.mark.parametrize("fmt", [(), ("--kv-rows",)], ids=["events", "rows"])
def test_cache_aware_follows_kv_events(spawn, fmt):
    a = spawn("--worker-id", "a", "--kv-events", *fmt)
    b = spawn("--worker-id", "b", "--kv-events", *fmt)

    async def main():
        async with Router(config(policy="cache_aware", worker=(a.url, b.url), predicted_kv_ttl_s=0.0)) as r:
            assert r.registry.fingerprint() == "fake-model"
            q = request(1, prompt_len=1024)
            toks, events = await collect(r, q)
            home = events[0].worker_id
            await until(lambda: len(r.registry.index) >= 8)  # the worker's stored event arrived
            for i in range(4):  # same 1024-token prefix, new tails: all go where the prefix is
                follow = GenerateRequest(f"f{i}", q.prompt_token_ids + [i] * 50, SamplingParams(max_tokens=3))
                _, evs = await collect(r, follow)
                assert evs[0].worker_id == home

    asyncio.run(main())


@pytest.mark.parametrize("server", SERVERS)
def test_registry_health_and_self_registration_via_the_service(spawn, server):
    """The router service over sockets, on each HTTP server of ``router.serving``."""
    a = spawn("--worker-id", "a", "--token-delay", "0.005")
    b = spawn("--worker-id", "b", "--dp", "2")

    async def main():
        router = Router(config(worker=(a.url,), server=server))
        service = RouterService(router.config, router=router)
        await service.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{service.port}"
        try:
            client = WorkerClient(base)  # the gateway's client works against the router service
            assert await client.health()
            q = request(5, max_tokens=12)
            assert [t async for ev in client.generate(q) for t in ev.token_ids] == expected(q)
            q1 = request(6, max_tokens=1)  # one event: answered without streaming
            assert [t async for ev in client.generate(q1) for t in ev.token_ids] == expected(q1)
            async with aiohttp.ClientSession() as s:
                # a client that disconnects mid-stream: the request is aborted on the worker
                resp = await s.post(base + "/internal/generate", data=GenerateRequestBody(request(8, max_tokens=500)))
                await resp.content.readline()
                resp.close()
                await until(lambda: router.num_in_flight == 0)
                await until_async(lambda: stats(a.url), lambda st: st.get("abort_calls", 0) >= 1)
                async with s.post(base + "/register", json={"url": b.url, "role": "oracle"}) as resp:
                    assert resp.status == 400  # a role that is none of deepserve.protocol.Role
                async with s.post(base + "/register", json={"url": b.url}) as resp:
                    assert (await resp.json())["worker_id"] == "b"
                async with s.get(base + "/workers") as resp:
                    ws = {w["worker_id"]: w for w in (await resp.json())["workers"]}
                    assert set(ws) == {"a", "b"} and ws["b"]["dp"] == 2 and ws["b"]["available"]
                async with s.post(base + "/deregister", json={"worker_id": "a"}) as resp:
                    assert resp.status == 200
                async with s.post(base + "/deregister", json={"worker_id": "nope"}) as resp:
                    assert resp.status == 404
                async with s.get(base + "/metrics") as resp:
                    assert "deepserve_router_decisions_total" in await resp.text()
                async with s.post(base + "/internal/generate", json={"nope": 1}) as resp:
                    assert resp.status == 400
                bad = {"request_id": "bad", "prompt_token_ids": ["a"], "sampling": {"max_tokens": 2}}
                async with s.post(base + "/internal/generate", json=bad) as resp:
                    assert resp.status == 400  # refused here: never reaches (and never hurts) a worker
            assert [w.worker_id for w in router.registry.workers()] == ["b"]
            load = await client.load()
            assert load.ranks[0].running == 0
            a_worker_gone = request(7, max_tokens=4)
            assert [t async for ev in client.generate(a_worker_gone) for t in ev.token_ids] == expected(a_worker_gone)
            # health from request outcomes and polls: a killed worker becomes unavailable
            b.kill9()
            await until(lambda: not router.registry.get("b").available)
            assert not await client.health()
            await client.close()
        finally:
            await service.stop()

    asyncio.run(main())
