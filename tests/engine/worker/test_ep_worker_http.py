"""``deepserve engine --device cpu --ep 2`` as a real process over loopback HTTP: one worker, two
gloo rank processes, two DP ranks in ``/load``; requests pinned to each rank (and one left to the
worker's choice) stream exactly the greedy tokens of one plain engine; the worker stops cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from deepserve.protocol import GenerateRequest
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from tests.engine.parallel.ep_engine_ranks import request
from tests.integration.workers import AUTH, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = {"h0": (7, 0), "h1": (200, 1), "h2": (33, 1), "h3": (12, None)}  # id -> (prompt length, dp_rank)


def _plain(model_dir, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    core = build_engine(model_dir, EngineConfig(kv_cache="off", max_num_batched_tokens=128))
    for r in reqs:
        core.add_request(r)
    out: dict[str, list[int]] = {}
    while core.has_work():
        for ev in core.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out


async def _generate(s: aiohttp.ClientSession, url: str, req: GenerateRequest, dp_rank: int | None) -> list[int]:
    body = req.to_dict() | {"dp_rank": dp_rank}
    tokens: list[int] = []
    async with s.post(url + "/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.strip():
                ev = json.loads(line)
                assert ev.get("error") is None, ev
                tokens += ev.get("token_ids", [])
    return tokens


def test_ep2_worker_over_http_equals_one_engine(small_windows_model_dir, tmp_path) -> None:
    port = free_port()
    log = open(tmp_path / "worker.log", "w")
    cmd = [sys.executable, "-m", "deepserve.cli", "engine", "--model", str(small_windows_model_dir), "--device", "cpu",
           "--dtype", "float32", "--ep", "2", "--port", str(port), "--kv-cache", "off", "--max-num-batched-tokens", "128",
           "--max-num-seqs", "8", "--static-max-tokens", "512", "--state-memory-bytes", str(64 << 20)]  # fmt: skip
    env = os.environ | {"DEEPSERVE_INTERNAL_TOKEN": AUTH.token, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    reqs = {rid: request(rid, n, 1000) for rid, (n, _) in PROMPTS.items()}

    async def main() -> tuple[dict, dict[str, list[int]]]:
        async with aiohttp.ClientSession(headers=AUTH.headers()) as s:
            deadline = time.monotonic() + 180
            while True:
                try:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
                await asyncio.sleep(0.3)
            async with s.get(url + "/load") as r:
                load = await r.json()
            got = await asyncio.gather(*(_generate(s, url, reqs[rid], rank) for rid, (_, rank) in PROMPTS.items()))
            return load, dict(zip(PROMPTS, got))

    try:
        load, got = asyncio.run(main())
        assert [r["dp_rank"] for r in load["ranks"]] == [0, 1]
        assert got == _plain(small_windows_model_dir, list(reqs.values()))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
