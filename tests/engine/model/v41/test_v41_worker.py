"""A real engine worker process serves a V4.1 fixture checkpoint over loopback HTTP: the
reference's greedy tokens and logprobs, streamed from ``/internal/generate``."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.engine.model.v41.conftest import fixture_case
from tests.integration.workers import TOKEN, start_workers

pytestmark = pytest.mark.timeout(180)


async def _generate(url: str, body: dict) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/internal/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.strip():
                    ev = json.loads(line)
                    tokens += ev.get("token_ids", [])
                    logprobs += [lp[0] for lp in ev.get("logprobs") or []]  # [logprob, top] pairs
    return tokens, logprobs


def test_worker_serves_v41(tmp_path) -> None:
    import asyncio

    ckpt, ref = fixture_case("engram")
    (w,) = start_workers(ckpt, tmp_path / "kv", ["mixed"], tmp_path)  # default KV settings: turned off for V4.1
    try:
        for i, p in enumerate(ref["prompts"][:2]):
            body = {"request_id": f"r{i}", "prompt_token_ids": p["prompt_ids"],
                    "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}}  # fmt: skip
            tokens, logprobs = asyncio.run(_generate(w.url, body))
            assert tokens == p["greedy_tokens"]
            assert max(abs(a - b) for a, b in zip(logprobs, p["greedy_logprobs"])) <= 1e-4
    finally:
        w.terminate()
