"""Registry health: active checks, request outcomes, static workers that come up late."""

from __future__ import annotations

import asyncio

from router.config import RouterConfig
from router.errors import WorkerUnavailable
from router.registry import WorkerRegistry
from tests.router.test_router_integration import free_port, until


def cfg(**kw) -> RouterConfig:
    return RouterConfig(load_interval_s=0.05, health_interval_s=0.1, breaker_failure_threshold=2, breaker_cooldown_s=0.2, **kw)


def test_static_worker_polled_until_it_comes_up(spawn):
    port = free_port()

    async def main():
        reg = WorkerRegistry(cfg(decode=(f"http://127.0.0.1:{port}",)))
        await reg.start()
        try:
            (w,) = reg.workers()
            assert not w.available and reg.candidates(("decode",)) == []
            spawn("--port", str(port), "--worker-id", "late", "--role", "decode", "--dp", "2")
            await until(lambda: reg.workers()[0].available)
            (w,) = reg.workers()
            assert w.worker_id == "late" and [v.key for v in reg.candidates(("decode",))] == [("late", 0), ("late", 1)]
        finally:
            await reg.stop()

    asyncio.run(main())


def test_outcomes_open_the_breaker_and_probes_close_it(spawn):
    f = spawn("--worker-id", "w")

    async def main():
        reg = WorkerRegistry(cfg(worker=(f.url,)))
        await reg.start()
        try:
            w = reg.get("w")
            v0 = reg.version
            reg.record_failure(w, WorkerUnavailable("boom", w.url))
            assert w.available and reg.version > v0
            reg.record_failure(w, WorkerUnavailable("boom", w.url))
            assert w.breaker.state == "open" and not w.available and reg.candidates(("mixed",)) == []
            await until(lambda: w.available)  # cooldown passed: half-open, a probe may go
            reg.dispatched(w)
            assert not w.available  # the probe slot is taken
            reg.record_success(w)
            assert w.breaker.state == "closed" and reg.candidates(("mixed",))
            # a refused connection marks it dead at once; the next poll brings it back
            reg.record_failure(w, WorkerUnavailable("refused", w.url, connect=True))
            assert not w.alive
            await until(lambda: w.alive)
        finally:
            await reg.stop()

    asyncio.run(main())


def test_deregister_with_drain_waits_for_in_flight(spawn):
    f = spawn("--worker-id", "w", "--dp", "2")

    async def main():
        reg = WorkerRegistry(cfg())
        await reg.add(f.url)
        try:
            w = reg.get("w")
            w.ranks[1].in_flight = 1  # one of our requests still runs there
            await reg.remove("w")
            assert not w.available and reg.workers() == [w]
            w.ranks[1].in_flight = 0
            await until(lambda: reg.workers() == [])
        finally:
            await reg.stop()

    asyncio.run(main())


def test_router_rehashes_when_a_worker_reports_a_new_fingerprint():
    """The router reads the fingerprint only when the registry's version moves; a changed
    fingerprint in a load report must move it."""
    from deepserve.protocol import GenerateRequest, SamplingParams
    from kvstore.keys import chain_keys
    from router.circuit_breaker import CircuitBreaker
    from router.policies.base import RankView
    from router.registry import Worker
    from router.router import Router

    r = Router(RouterConfig(policy="cache_aware"))
    reg = r.registry
    w = Worker(url="u", worker_id="w", role="mixed", client=None, breaker=CircuitBreaker(2, 1.0), alive=True, accepting=True)
    w.ranks = [RankView(worker_id="w", cache=reg.index)]
    reg._workers["w"] = w
    load = {"worker_id": "w", "role": "mixed", "ranks": [{"dp_rank": 0}], "block_size": 128}
    prompt = list(range(300))
    req = GenerateRequest(request_id="r", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1))
    for fp in ("fp-1", "fp-1", "fp-2", ""):
        reg._apply_load(w, {**load, "fingerprint": fp})
        assert list(r.route_request(req).block_keys) == chain_keys(prompt, 128, fp)


class _LogClient:
    """A worker's ``/kv_events`` over a real ``KVEventLog``, as the worker server answers it."""

    def __init__(self, log) -> None:
        self.log = log
        self.asked: list[str] = []

    async def kv_events_raw(self, since: int = 0, *, snapshot: bool = False):
        from router.worker_client import KVEventsAnswer

        self.asked.append("snapshot" if snapshot else f"since={since}")
        batch = self.log.snapshot() if snapshot else self.log.since(since)
        return KVEventsAnswer(batch.seq, [e.to_row() for e in batch.events], [], batch.complete)


def test_poller_that_fell_behind_the_ring_rebuilds_from_the_snapshot():
    """``complete: false`` drops the worker's units (a removal it missed included) and applies
    the snapshot; the cursor then continues from the snapshot's sequence number."""
    from kvstore.events import KVEventLog
    from router.circuit_breaker import CircuitBreaker
    from router.registry import Worker

    reg = WorkerRegistry(cfg())
    log = KVEventLog(capacity=2)
    client = _LogClient(log)
    w = Worker(url="u", worker_id="w", role="mixed", client=client, breaker=CircuitBreaker(2, 1.0), alive=True)
    index = reg.index

    async def main():
        log.publish("stored", ["a", "b"], "memory", dp_rank=0)
        await reg._poll_kv(w)
        assert index.match(["a", "b"]).local == {("w", 0): 2}
        log.publish("removed", ["a", "b"], "memory")  # missed: pushed out of the ring below
        log.publish("stored", ["c"], "memory", dp_rank=1)
        log.publish("stored", ["d"], "memory", dp_rank=0)
        await reg._poll_kv(w)
        assert client.asked == ["since=0", "since=1", "snapshot"]
        assert index.match(["a"]).local == {} and index.match(["c"]).local == {("w", 1): 1}
        assert index.match(["d"]).local == {("w", 0): 1} and w.kv_seq == log.seq
        log.publish("removed", ["d"], "memory")
        await reg._poll_kv(w)
        assert client.asked[-1] == f"since={log.seq - 1}" and index.match(["d"]).local == {}

    asyncio.run(main())
