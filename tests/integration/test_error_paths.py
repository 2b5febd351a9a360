"""Error codes end to end: a real worker process, the router (in-process and as a service), the
gateway's one mapping (``server.errors.translate``).

Each failure keeps the ``ErrorCode`` the worker gave it all the way up: a bad token id
(``invalid_request``), a prompt beyond ``--max-model-len`` (``context_length_exceeded``), a rank
whose ``--max-queue`` is full (``engine_full``), a worker nobody can reach (``unavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from deepserve.protocol import ErrorCode, GenerateRequest, SamplingParams, parse_error_body
from router.config import RouterConfig
from router.errors import NoWorkerAvailable, RequestRejected, RouterError, WorkerRejected, WorkerUnavailable
from router.router import Router
from router.service import RouterService
from router.worker_client import WorkerClient
from server.errors import translate
from tests.integration.workers import AUTH, free_port, start_workers

pytestmark = pytest.mark.timeout(180)

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    extra = ("--kv-cache", "off", "--static-decode", "off", "--max-queue", "1", "--max-model-len", str(MAX_MODEL_LEN))
    (w,) = start_workers(tiny_model_dir, tmp_path_factory.mktemp("kv"), ["mixed"], tmp_path_factory.mktemp("logs"), extra=extra)
    yield w
    w.terminate()


def _request(rid: str, prompt: list[int], max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _config(url: str) -> RouterConfig:
    return RouterConfig(worker=(url,), max_retries=1, backoff_base_s=0.01, load_interval_s=0.1, health_interval_s=0.2)


async def _router_error(router: Router, req: GenerateRequest) -> RouterError:
    with pytest.raises(RouterError) as info:
        async for _ in router.generate(req):
            pass
    return info.value


@pytest.mark.parametrize(
    "prompt,max_tokens,code",
    [([5, 6, 10**7], 4, ErrorCode.INVALID_REQUEST), (list(range(5, 105)), MAX_MODEL_LEN, ErrorCode.CONTEXT_LENGTH_EXCEEDED)],
)
def test_client_faults_keep_their_code_through_router_and_service(worker, prompt, max_tokens, code) -> None:
    async def main() -> None:
        client = WorkerClient(worker.url, auth=AUTH)  # the worker itself: its HTTP error body
        with pytest.raises(WorkerRejected) as direct:
            async for _ in client.generate(_request("direct", prompt, max_tokens)):
                pass
        assert direct.value.code is code
        await client.close()

        router = Router(_config(worker.url), auth=AUTH)
        service = RouterService(router.config, router=router, auth=AUTH)
        await service.start("127.0.0.1", 0)
        try:
            err = await _router_error(router, _request("routed", prompt, max_tokens))
            assert isinstance(err, RequestRejected) and err.code is code
            via = WorkerClient(f"http://127.0.0.1:{service.port}", auth=AUTH)  # the gateway's client of a router service
            with pytest.raises(WorkerRejected) as remote:
                async for _ in via.generate(_request("remote", prompt, max_tokens)):
                    pass
            await via.close()
            assert remote.value.code is code
            for exc in (err, remote.value):
                gw = translate(exc)
                assert (gw.status, gw.code) == (400, code.value)
        finally:
            await service.stop()

    asyncio.run(main())


def test_a_full_rank_answers_engine_full(worker) -> None:
    async def main() -> None:
        router = Router(_config(worker.url), auth=AUTH)
        await router.start()
        long = router.generate(_request("long", list(range(5, 45)), max_tokens=MAX_MODEL_LEN - 40))
        try:
            assert (await anext(long)).token_ids  # the rank's one place is taken
            client = WorkerClient(worker.url, auth=AUTH)
            with pytest.raises(WorkerUnavailable) as direct:
                async for _ in client.generate(_request("direct-full", [5, 6, 7])):
                    pass
            await client.close()
            assert direct.value.code is ErrorCode.ENGINE_FULL
            err = await _router_error(router, _request("routed-full", [5, 6, 7]))
            assert isinstance(err, NoWorkerAvailable) and err.code is ErrorCode.ENGINE_FULL
            gw = translate(err)
            assert (gw.status, gw.code, gw.headers) == (503, "engine_full", {"Retry-After": "1"})
        finally:
            await router.abort("long")
            with contextlib.suppress(StopAsyncIteration):
                while True:
                    await anext(long)
            await router.stop()

    asyncio.run(main())


def test_an_unreachable_worker_is_unavailable() -> None:
    async def main() -> None:
        router = Router(_config(f"http://127.0.0.1:{free_port()}"), auth=AUTH)
        await router.start()
        try:
            err = await _router_error(router, _request("nobody", [5, 6, 7]))
        finally:
            await router.stop()
        assert err.code is ErrorCode.UNAVAILABLE
        assert translate(err).status == 503

    asyncio.run(main())


def test_the_worker_http_error_body_is_typed(worker) -> None:
    import urllib.request

    req = urllib.request.Request(worker.url + "/kv_events?since=x", headers=AUTH.headers())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    assert info.value.code == 400
    assert parse_error_body(info.value.read()).code is ErrorCode.INVALID_REQUEST
