"""A worker whose engine thread dies fails its open streams, reports 503 and exits with status 1
(for its supervisor to restart it). The death is injected into a real worker process: its
``EngineLoop._deliver`` raises for one request id, outside any per-request containment."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.integration.workers import AUTH, free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import sys
from engine.runtime.config import EngineConfig
from engine.worker import loop
from engine.worker.server import WorkerConfig, run_worker
from deepserve.internal_auth import InternalAuth

real = loop.EngineLoop._deliver

def deliver(self, ev):
    if ev.request_id == "kill-engine":
        raise RuntimeError("injected engine-thread fault")
    return real(self, ev)

loop.EngineLoop._deliver = deliver
run_worker(WorkerConfig(model_dir=sys.argv[1], port=int(sys.argv[2]), dtype="float32", auth=InternalAuth(sys.argv[3]),
                        engine=EngineConfig(kv_cache="off", static_decode=False)))
"""


def _body(rid: str, n: int) -> dict:
    return {"request_id": rid, "prompt_token_ids": list(range(5, 30)), "sampling": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}}


def test_a_dead_engine_thread_ends_the_worker(tiny_model_dir, tmp_path) -> None:
    port = free_port()
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(port), AUTH.token], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    async def main() -> None:
        async with aiohttp.ClientSession(headers=AUTH.headers()) as s:
            deadline = time.monotonic() + 90
            while True:
                try:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
                await asyncio.sleep(0.2)
            async with s.post(url + "/internal/generate", json=_body("victim", 20_000)) as victim:
                assert victim.status == 200
                await victim.content.readline()  # running
                killer = asyncio.create_task(s.post(url + "/internal/generate", json=_body("kill-engine", 4)))  # never answered
                last = {}
                async for line in victim.content:
                    if line.strip():
                        last = json.loads(line)
                assert (last.get("finish_reason"), last.get("error")) == ("error", "the engine stopped")
                killer.cancel()

    try:
        asyncio.run(main())
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
