"""A real engine worker process serves a V4.1 fixture checkpoint over loopback HTTP: the
reference's greedy tokens and logprobs, streamed from ``/internal/generate``; with the KV store
on (the default), a repeated long prompt resumes from its stored prefix and says so."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import aiohttp
import pytest

from tests.engine.model.v41.conftest import BAR, fixture_case
from tests.integration.workers import TOKEN, WorkerProcess, start_workers

pytestmark = pytest.mark.timeout(180)


async def _generate(url: str, body: dict) -> tuple[list[int], list[float], int]:
    """(tokens, chosen logprobs, cached prompt tokens) of one streamed request."""
    tokens, logprobs, cached = [], [], 0
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/internal/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.strip():
                    ev = json.loads(line)
                    tokens += ev.get("token_ids", [])
                    logprobs += [lp[0] for lp in ev.get("logprobs") or []]  # [logprob, top] pairs
                    cached = max(cached, ev.get("num_cached_tokens", 0))
    return tokens, logprobs, cached


def _body(rid: str, prompt: list[int]) -> dict:
    return {"request_id": rid, "prompt_token_ids": prompt,
            "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}}  # fmt: skip


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[tuple[WorkerProcess, dict]]:
    ckpt, ref = fixture_case("engram")
    tmp = tmp_path_factory.mktemp("v41-worker")
    (w,) = start_workers(ckpt, tmp / "kv", ["mixed"], tmp)  # default KV settings: readwrite, memory + fs tiers
    try:
        yield w, ref
    finally:
        w.terminate()


def test_worker_serves_v41(worker) -> None:
    w, ref = worker
    for i, p in enumerate(ref["prompts"][:2]):
        tokens, logprobs, _ = asyncio.run(_generate(w.url, _body(f"r{i}", p["prompt_ids"])))
        assert tokens == p["greedy_tokens"]
        assert max(abs(a - b) for a, b in zip(logprobs, p["greedy_logprobs"])) <= BAR


def test_worker_resumes_a_stored_prefix(worker) -> None:
    """The second request of a 300-token prompt starts from the stored units (256 cached
    tokens) and streams the first request's tokens and logprobs."""
    w, ref = worker
    pool = [t for p in ref["prompts"] for t in p["prompt_ids"] + p["greedy_tokens"]]
    rng = random.Random(0)
    prompt = [pool[rng.randrange(len(pool))] for _ in range(300)]
    cold = asyncio.run(_generate(w.url, _body("long-a", prompt)))
    hit = asyncio.run(_generate(w.url, _body("long-b", prompt)))
    assert cold[2] == 0 and hit[2] == 256
    assert hit[0] == cold[0]
    assert max(abs(a - b) for a, b in zip(hit[1], cold[1])) <= BAR
