"""A real worker process refuses malformed internal requests with 400 and keeps serving.

Each poison body below once reached the engine thread: a constraint ``spec`` that is an object
killed the thread (every later request hung while ``/health`` stayed 200), ``seed: "x"`` and
``top_k: 1e20`` failed the step and with it every other user's stream on the rank. Now each is a
400 at the boundary, the streams running beside them end with the tokens they have alone, and
the worker still serves.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.integration.workers import start_workers

pytestmark = pytest.mark.timeout(180)

PROMPT = list(range(5, 45))
POISON_SAMPLING = [
    {"constraint": {"kind": "json", "spec": {}}},
    {"seed": "x"},
    {"top_k": 1e20},
    {"top_k": True},
    {"temperature": "hot"},
    {"stop_token_ids": [1, "a"]},
    {"constraint": {"kind": "sql", "spec": ""}},
    {"seed": 2**70},
    {"max_tokens": 0},
]


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    (w,) = start_workers(tiny_model_dir, tmp_path_factory.mktemp("kv"), ["mixed"], tmp_path_factory.mktemp("logs"), extra=("--kv-cache", "off", "--static-decode", "off"))
    yield w
    w.terminate()


def _body(rid: str, **sampling) -> dict:
    return {"request_id": rid, "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True, **sampling}}


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async with session.post(url + "/internal/generate", json=body, headers=auth_headers()) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.strip():
                ev = json.loads(line)
                tokens += ev.get("token_ids", [])
                reason = ev.get("finish_reason") or reason
    return tokens, reason


def auth_headers() -> dict[str, str]:
    from tests.integration.workers import TOKEN

    return {"Authorization": f"Bearer {TOKEN}"}


async def _poison(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, dict]:
    async with session.post(url + "/internal/generate", data=data, headers={"Content-Type": "application/json", **auth_headers()}) as resp:
        return resp.status, await resp.json(content_type=None)


def test_poison_requests_get_400_and_leave_other_streams_untouched(worker) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            alone, _ = await _stream(s, worker.url, _body("alone"))
            streams = [asyncio.create_task(_stream(s, worker.url, _body(f"user-{i}"))) for i in range(3)]
            await asyncio.sleep(0.05)
            bodies = [json.dumps(_body(f"bad-{i}", **p)).encode() for i, p in enumerate(POISON_SAMPLING)]
            bodies += [b"[" * 1000 + b"]" * 1000, b'{"request_id": "deep", "prompt_token_ids": [1], "sampling": ' + b"[" * 5000 + b"]" * 5000 + b"}"]
            bodies += [b"not json", json.dumps({"request_id": {"a": 1}, "prompt_token_ids": [1]}).encode()]
            for data in bodies:
                status, err = await _poison(s, worker.url, data)
                assert status == 400, (data[:80], status, err)
                assert "Traceback" not in json.dumps(err)
            for task in streams:
                tokens, reason = await task
                assert (tokens, reason) == (alone, "length")
            for path, data in (("/internal/abort", b"[" * 100_000), ("/internal/abort", b"{}"), ("/internal/abort", b"nope")):
                async with s.post(worker.url + path, data=data, headers=auth_headers()) as resp:
                    assert resp.status == 400, (path, data[:20])
            async with s.get(worker.url + "/kv_events?since=x", headers=auth_headers()) as resp:
                assert resp.status == 400
            again, reason = await _stream(s, worker.url, _body("after"))
            assert (again, reason) == (alone, "length")
            async with s.get(worker.url + "/health") as resp:
                assert resp.status == 200

    asyncio.run(main())


def test_internal_routes_need_the_token_but_health_does_not(worker) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            body = _body("no-token")
            for method, path, kw in (("POST", "/internal/generate", {"json": body}), ("POST", "/internal/abort", {"json": {"request_id": "x"}}),
                                     ("GET", "/load", {}), ("GET", "/kv_events", {}), ("GET", "/metrics", {})):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "integration-test-internal-token"}):
                    async with s.request(method, worker.url + path, headers=headers, **kw) as resp:
                        assert resp.status == 401, (path, headers)
                async with s.request(method, worker.url + path, headers=auth_headers(), **kw) as resp:
                    assert resp.status == 200, path
            async with s.get(worker.url + "/health") as resp:
                assert resp.status == 200

    asyncio.run(main())


def test_a_worker_beyond_loopback_refuses_to_start_without_a_token(tiny_model_dir) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPSERVE_INTERNAL_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "deepserve.cli", "engine", "--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "without an internal token" in done.stderr
