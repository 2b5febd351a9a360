"""Upstream read deadlines: a worker that stops producing is treated like a dead one.

FAKE worker processes (tests/router/fake_worker.py) on loopback: one is stopped with SIGSTOP
while streams run on it; its streams migrate to the other worker and end with exactly the
tokens of an undisturbed run, within the suspect deadline rather than never; on each
``router.transport`` implementation (the library's in the slow run).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from router.router import Router
from tests.router.test_router_integration import config, expected, request

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["http1", pytest.param("aiohttp", marks=pytest.mark.slow)])
def test_streams_of_a_sigstopped_worker_finish_on_the_other_one(spawn, transport):
    a = spawn("--worker-id", "a", "--token-delay", "0.02")
    b = spawn("--worker-id", "b", "--token-delay", "0.02")
    procs = {"a": a, "b": b}

    async def main():
        router = Router(config(worker=(a.url, b.url), load_interval_s=0.2, suspect_timeout_s=1.0, event_timeout_s=30.0, transport=transport))
        await router.start()
        stopped: list[str] = []
        try:
            reqs = [request(100 + i, max_tokens=120) for i in range(6)]
            seen: dict[str, list[str]] = {r.request_id: [] for r in reqs}

            async def run(req):
                tokens = []
                async for ev in router.generate(req):
                    assert ev.finish_reason != "error", ev.error
                    tokens += ev.token_ids
                    if ev.worker_id:
                        seen[req.request_id].append(ev.worker_id)
                return tokens

            tasks = [asyncio.create_task(run(r)) for r in reqs]
            while sum(len(v) for v in seen.values()) < 30:
                await asyncio.sleep(0.01)
            victim = seen[reqs[0].request_id][-1]
            os.kill(procs[victim].proc.pid, signal.SIGSTOP)
            stopped.append(victim)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            took = time.monotonic() - t0
            for req, tokens in zip(reqs, results):
                assert tokens == expected(req)
            moved = [rid for rid, ws in seen.items() if victim in ws and ws[-1] != victim]
            assert moved, "no stream ran on the stopped worker"
            assert took < 12, f"the stopped worker's streams took {took:.1f}s to finish"
            assert router.metrics.migrations._value.get() >= len(moved)
        finally:
            for name in stopped:
                os.kill(procs[name].proc.pid, signal.SIGCONT)
            await router.stop()

    asyncio.run(main())
