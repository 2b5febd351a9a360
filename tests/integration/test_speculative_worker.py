"""Speculative decoding in a real ``deepserve engine`` process over HTTP, for each family: the
trained tiny V4 model drafting with its MTP layer, the trained tiny V4.1 model with its DSpark
draft layers.

Two workers, one with ``--speculative-config`` and one without, give the same greedy tokens for
batched requests of mixed lengths that cross 128-token units (their KV store on, so drafts stop at
each unit boundary); the speculative one reports drafts and acceptances under vLLM's metric names.
Through the router, a plain prefill worker handing off to a speculative decode worker (sharing a
KV tier) gives those tokens too, and so does a speculative decode worker killed with SIGKILL
mid-stream, its streams migrated to another speculative decode worker.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import pytest

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.model.tiny_mtp import TrainConfig, sentence
from router.config import RouterConfig
from router.router import Router
from router.worker_client import WorkerClient
from tests.integration.workers import AUTH, start_workers

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# method → (checkpoint fixture, acceptance bar: accepted / drafted tokens, well above zero; the
# DSpark layers accept less on these prompts' random-token stretches: 0.39 in the engine tests)
FAMILIES = {"mtp": ("trained_mtp_model_dir", 0.5), "dspark": ("trained_dspark_model_dir", 0.3)}


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest):
    """(checkpoint dir, method, acceptance bar) of one drafting family."""
    fixture, bar = FAMILIES[request.param]
    return request.getfixturevalue(fixture), request.param, bar


def _spec(method: str, k: int) -> tuple[str, str]:
    return "--speculative-config", f'{{"method": "{method}", "num_speculative_tokens": {k}}}'


def _requests(max_tokens: int = 48, lengths: tuple[int, ...] = (3, 120, 200, 60)) -> list[GenerateRequest]:
    rng, lang = random.Random(5), TrainConfig()
    prompts = [[rng.randrange(2, 129280) for _ in range(n)] + sentence(lang, 1000 + n % 64, 4) for n in lengths]
    return [GenerateRequest(f"h{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]


async def _generate(url: str, reqs: list[GenerateRequest] | None = None) -> dict[str, list[int]]:
    client = WorkerClient(url, auth=AUTH)

    async def one(req: GenerateRequest) -> tuple[str, list[int]]:
        tokens = []
        async for ev in client.generate(req):
            assert ev.finish_reason != "error", ev.error
            tokens += ev.token_ids
        return req.request_id, tokens

    try:
        return dict(await asyncio.gather(*(one(r) for r in reqs or _requests())))
    finally:
        await client.close()


def _metric(url: str, name: str) -> float:
    req = urllib.request.Request(url + "/metrics", headers=AUTH.headers())
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_speculative_worker_gives_the_plain_workers_tokens(family, tmp_path_factory) -> None:
    ckpt, method, bar = family
    logs = tmp_path_factory.mktemp("logs")
    spec = start_workers(ckpt, tmp_path_factory.mktemp("kv-spec"), ["mixed"], logs, extra=_spec(method, 3))[0]
    plain = start_workers(ckpt, tmp_path_factory.mktemp("kv-plain"), ["mixed"], logs)[0]
    try:
        want = asyncio.run(_generate(plain.url))
        got = asyncio.run(_generate(spec.url))
        assert got == want and all(len(t) == 48 for t in got.values())
        drafts = _metric(spec.url, "vllm:spec_decode_num_draft_tokens_total")
        accepted = _metric(spec.url, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted > bar * drafts > 0, (accepted, drafts)
        assert _metric(spec.url, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert _metric(plain.url, "vllm:spec_decode_num_drafts_total") == 0
    finally:
        spec.terminate()
        plain.terminate()


async def _through_router(prefill: str, decode: str) -> dict[str, list[int]]:
    config = RouterConfig(policy="least_load", load_interval_s=0.1, health_interval_s=0.2, kv_events_interval_s=0.2,
                          backoff_base_s=0.01, pd_min_prompt_tokens=0, prefill=(prefill,), decode=(decode,))  # fmt: skip
    router = Router(config, auth=AUTH)
    await router.start()

    async def one(req: GenerateRequest) -> tuple[str, list[int]]:
        tokens, workers = [], set()
        async for ev in router.generate(req):
            assert ev.finish_reason != "error", ev.error
            tokens += ev.token_ids
            workers.add((ev.worker_id or "").split("-")[0])
        assert {"prefill", "decode"} <= workers
        return req.request_id, tokens

    try:
        return dict(await asyncio.gather(*(one(r) for r in _requests())))
    finally:
        await router.stop()


def test_prefill_handoff_to_a_speculative_decode_worker(family, tmp_path_factory) -> None:
    ckpt, method, _ = family
    logs, kv = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("kv-pd")
    prefill, decode = start_workers(ckpt, kv, ["prefill", "decode"], logs, extra=_spec(method, 2))
    plain = start_workers(ckpt, tmp_path_factory.mktemp("kv-plain2"), ["mixed"], logs)[0]
    try:
        want = asyncio.run(_generate(plain.url))
        assert asyncio.run(_through_router(prefill.url, decode.url)) == want
        assert _metric(decode.url, "vllm:spec_decode_num_accepted_tokens_total") > 0
    finally:
        for w in (prefill, decode, plain):
            w.terminate()


def test_speculative_decode_worker_killed_mid_stream_migrates(family, tmp_path_factory) -> None:
    ckpt, method, _ = family
    logs, kv = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("kv-mig")
    prefill = start_workers(ckpt, kv, ["prefill"], logs)[0]
    victim, survivor = start_workers(ckpt, kv, ["decode", "decode"], logs, extra=_spec(method, 3))
    plain = start_workers(ckpt, tmp_path_factory.mktemp("kv-plain3"), ["mixed"], logs)[0]
    reqs = lambda: _requests(max_tokens=200, lengths=(3, 120, 200, 60, 90, 150))  # noqa: E731
    config = RouterConfig(policy="round_robin", load_interval_s=0.1, health_interval_s=0.2, kv_events_interval_s=0.2, backoff_base_s=0.01,
                          pd_min_prompt_tokens=0, prefill=(prefill.url,), decode=(victim.url, survivor.url))  # fmt: skip
    dead = f"decode-0-{victim.port}"

    async def scenario() -> dict[str, tuple[list[int], list[str]]]:
        router = Router(config, auth=AUTH)
        await router.start()
        seen: list[str] = []

        async def one(req: GenerateRequest) -> tuple[str, tuple[list[int], list[str]]]:
            tokens, workers = [], []
            async for ev in router.generate(req):
                assert ev.finish_reason != "error", ev.error
                tokens += ev.token_ids
                if ev.token_ids:
                    workers.append(ev.worker_id or "")
                    seen.append(ev.worker_id or "")
            return req.request_id, (tokens, workers)

        async def kill_when_streaming() -> None:
            for _ in range(4000):  # until the victim has streamed some tokens
                if seen.count(dead) >= 3:
                    break
                await asyncio.sleep(0.005)
            victim.kill()

        try:
            killer = asyncio.create_task(kill_when_streaming())
            out = dict(await asyncio.gather(*(one(r) for r in reqs())))
            await killer
            return out
        finally:
            await router.stop()

    try:
        want = asyncio.run(_generate(plain.url, reqs()))
        got = asyncio.run(scenario())
        assert victim.proc.poll() is not None
        assert {r: t for r, (t, _) in got.items()} == want
        assert any(dead in ws and ws[-1] != dead for _, ws in got.values()), "no stream was migrated"
        assert _metric(survivor.url, "vllm:spec_decode_num_accepted_tokens_total") > 0
    finally:
        for w in (prefill, victim, survivor, plain):
            w.terminate()
