"""The router service's internal plane: its token on every route but ``/health``, the token sent
on to the workers, registration bound to the caller's own address and to ids nobody live holds.
FAKE workers (tests/router/fake_worker.py) that require the token, real HTTP on loopback.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest

from deepserve.internal_auth import InternalAuth
from router.router import Router
from router.service import RouterService, serve
from router.worker_client import WorkerClient
from tests.router.test_router_integration import config, expected, request

TOKEN = "router-test-token"
AUTH = InternalAuth(TOKEN)
GOOD = {"Authorization": f"Bearer {TOKEN}"}


async def _service(cfg, auth: InternalAuth = AUTH) -> tuple[RouterService, str]:
    service = RouterService(cfg, router=Router(cfg, auth=auth), auth=auth)
    await service.start("127.0.0.1", 0)
    return service, f"http://127.0.0.1:{service.port}"


def test_every_route_but_health_needs_the_token_and_the_router_sends_it_on(spawn):
    victim = spawn("--worker-id", "w", "--require-token", TOKEN)

    async def main():
        service, base = await _service(config(worker=(victim.url,)))
        try:
            routes = [("POST", "/internal/generate", {"json": request(1).to_dict()}), ("POST", "/internal/abort", {"json": {"request_id": "x"}}),
                      ("GET", "/load", {}), ("GET", "/kv_events", {}), ("GET", "/metrics", {}), ("GET", "/workers", {}),
                      ("POST", "/register", {"json": {"url": victim.url}}), ("POST", "/deregister", {"json": {"worker_id": "nope"}}),
                      ("POST", "/drain", {"json": {"worker_id": "nope"}}), ("GET", "/no-such-route", {})]
            async with aiohttp.ClientSession() as s:
                for method, path, kw in routes:
                    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
                        async with s.request(method, base + path, headers=headers, **kw) as resp:
                            assert resp.status == 401, (path, headers)
                            assert (await resp.json())["error"]["code"] == "unauthorized"
                async with s.get(base + "/health") as resp:
                    assert resp.status == 200 and await resp.json() == {"status": "ok", "available": 1, "workers": 1}
            client = WorkerClient(base, auth=AUTH)  # what the gateway uses
            q = request(2, max_tokens=6)
            assert [t async for ev in client.generate(q) for t in ev.token_ids] == expected(q)  # the worker required the token too
            assert (await client.load()).ranks
            await client.close()
            anonymous = WorkerClient(base)
            assert not [t async for ev in _tokens_or_none(anonymous, request(3))]
            await anonymous.close()
        finally:
            await service.stop()

    asyncio.run(main())


async def _tokens_or_none(client: WorkerClient, req):
    """The tokens of ``req``, or nothing when the call is refused: a 401 is the caller's
    configuration at fault, not the request (``WorkerUnavailable``, not ``WorkerRejected``)."""
    from router.errors import WorkerUnavailable

    try:
        async for ev in client.generate(req):
            yield ev
    except WorkerUnavailable as exc:
        assert "401" in str(exc)


def test_open_metrics_serves_metrics_without_the_token(spawn):
    async def main():
        service, base = await _service(replace(config(), open_metrics=True))
        try:
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
                assert resp.status == 200 and "deepserve_router" in await resp.text()
        finally:
            await service.stop()

    asyncio.run(main())


def test_a_rogue_worker_cannot_take_a_live_workers_id(spawn):
    victim = spawn("--worker-id", "victim", "--require-token", TOKEN)
    rogue = spawn("--worker-id", "victim", "--require-token", TOKEN)  # claims the same id

    async def main():
        service, base = await _service(config(worker=(victim.url,)))
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/register", json={"url": rogue.url}) as resp:
                    assert resp.status == 401  # no token: refused before anything else
                async with s.post(base + "/register", json={"url": rogue.url}, headers=GOOD) as resp:
                    assert resp.status == 403 and "held by the live worker" in (await resp.json())["error"]["message"]
                async with s.get(base + "/workers", headers=GOOD) as resp:
                    assert [(w["worker_id"], w["url"]) for w in (await resp.json())["workers"]] == [("victim", victim.url)]
            client = WorkerClient(base, auth=AUTH)
            for i in range(5):  # every request still goes to the real worker
                q = request(10 + i, max_tokens=4)
                assert [t async for ev in client.generate(q) for t in ev.token_ids] == expected(q)
            await client.close()
        finally:
            await service.stop()

    asyncio.run(main())


def test_registration_is_for_the_callers_own_address(spawn):
    w = spawn("--worker-id", "w2", "--require-token", TOKEN)

    async def main():
        service, base = await _service(config())
        try:
            async with aiohttp.ClientSession() as s:
                other = w.url.replace("127.0.0.1", "127.0.0.2")  # an address that is not the caller's
                async with s.post(base + "/register", json={"url": other}, headers=GOOD) as resp:
                    assert resp.status == 403 and "own address" in (await resp.json())["error"]["message"]
                async with s.post(base + "/register", json={"url": w.url.replace("127.0.0.1", "localhost")}, headers=GOOD) as resp:
                    assert resp.status == 200 and (await resp.json())["worker_id"] == "w2"
        finally:
            await service.stop()

    asyncio.run(main())


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_a_router_beyond_loopback_refuses_to_start_without_a_token(host):
    with pytest.raises(SystemExit, match="without an internal token"):
        serve(replace(config(), host=host))
