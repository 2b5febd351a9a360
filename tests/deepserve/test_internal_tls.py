"""Mutual TLS on the internal plane (deepserve/internal_tls.py), with certificates made here by the
``openssl`` CLI: a worker and a router service refuse a caller without a client certificate (or
with one from another CA) at TLS, answer one with it, and a chat request goes gateway -> router
service -> worker over mTLS (FAKE worker, tests/router/fake_worker.py; real HTTP, the openai SDK).
The slow test runs ``deepserve up`` with real engine workers on mTLS."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from deepserve.internal_auth import InternalAuth
from deepserve.internal_tls import InternalTLS
from router.config import RouterConfig
from router.router import Router
from router.service import RouterService
from router.serving import SERVERS
from router.worker_client import WorkerClient
from server.app import create_app
from server.config import GatewayConfig
from tests.router.conftest import spawn  # noqa: F401 (fixture)
from tests.router.test_router_integration import expected, request
from tests.server.conftest import MODEL, catalog, free_port, serve  # noqa: F401 (catalog: fixture)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
TOKEN = "tls-test-token"
LEAF_EXT = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _authority(d: Path, name: str) -> InternalTLS:
    """A CA and one leaf certificate it signs (both ends' usage, for 127.0.0.1), in ``d``."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem", "-days", "2",
             "-subj", f"/CN={name}-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(LEAF_EXT)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem", "-CAkey", f"{name}-ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return InternalTLS(str(d / f"{name}-ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, InternalTLS]:
    d = tmp_path_factory.mktemp("pki")
    return {"plane": _authority(d, "plane"), "rogue": _authority(d, "rogue")}


def _answer(port: int, ctx: ssl.SSLContext | None) -> str:
    """The first bytes a GET /health gets on ``port`` over ``ctx`` (None: plain TCP), or the
    error that ended the connection."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx is not None else raw
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return sock.recv(64).decode("latin-1") or "closed"  # closed: the server's TLS alert, then EOF
    except (ssl.SSLError, OSError) as exc:
        return f"refused: {exc}"


def _callers(pki: dict[str, InternalTLS]) -> dict[str, ssl.SSLContext | None]:
    """A caller with the plane's certificate, one that trusts the CA but has none, one with a
    certificate from another CA, and plain TCP."""
    no_cert = ssl.create_default_context(cafile=pki["plane"].ca)
    rogue = ssl.create_default_context(cafile=pki["plane"].ca)
    rogue.load_cert_chain(pki["rogue"].cert, pki["rogue"].key)
    return {"cert": pki["plane"].client_context, "no_cert": no_cert, "rogue": rogue, "plain": None}


def _check_mtls(port: int, pki: dict[str, InternalTLS]) -> None:
    answers = {who: _answer(port, ctx) for who, ctx in _callers(pki).items()}
    assert answers["cert"].startswith("HTTP/1.1 200"), answers
    for who in ("no_cert", "rogue", "plain"):  # the TLS layer ends them: no HTTP answer at all
        assert answers[who] == "closed" or answers[who].startswith("refused"), (who, answers[who])


def test_all_three_files_or_none() -> None:
    with pytest.raises(SystemExit, match="--internal-tls-key"):
        InternalTLS(ca="a", cert="b")
    assert not InternalTLS().enabled and InternalTLS().server_context is None and InternalAuth().client_ssl is None


def test_gateway_router_worker_over_mtls(pki: dict[str, InternalTLS], spawn: Any, catalog: Any) -> None:
    tls = pki["plane"]
    auth = InternalAuth(TOKEN, tls)
    worker = spawn("--worker-id", "w", "--require-token", TOKEN, "--tls", tls.ca, tls.cert, tls.key)
    assert worker.url.startswith("https://")
    _check_mtls(worker.port, pki)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = RouterConfig(worker=(worker.url,), load_interval_s=0.1, health_interval_s=0.2)
    service = RouterService(cfg, router=Router(cfg, auth=auth), auth=auth)
    asyncio.run_coroutine_threadsafe(service.start("127.0.0.1", 0), loop).result(30)
    router_url = f"https://127.0.0.1:{service.port}"
    try:
        _check_mtls(service.port, pki)

        async def through_router() -> None:
            client = WorkerClient(router_url, auth=auth)
            q = request(1, max_tokens=5)
            assert [t async for ev in client.generate(q) for t in ev.token_ids] == expected(q)
            await client.close()
            plain = InternalAuth(TOKEN)  # right token, no TLS: cannot even reach the router
            with pytest.raises(ValueError, match="https"):
                WorkerClient(router_url, auth=plain)

        asyncio.run(through_router())

        async def register_plain_url() -> int:
            import aiohttp

            connector = aiohttp.TCPConnector(ssl=tls.client_context)
            async with aiohttp.ClientSession(connector=connector, headers=auth.headers()) as s, \
                    s.post(router_url + "/register", json={"url": f"http://127.0.0.1:{free_port()}"}) as resp:
                return resp.status

        assert asyncio.run(register_plain_url()) == 400  # on an mTLS plane a worker's URL is https

        app = create_app(GatewayConfig(served_model_names=(MODEL,)), WorkerClient(router_url, auth=auth), catalog=catalog)
        with serve(app) as url:
            oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert 1 <= out.usage.completion_tokens <= 4
    finally:
        asyncio.run_coroutine_threadsafe(service.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.parametrize("server", SERVERS)
def test_router_service_requires_client_certificates_on_each_server(pki: dict[str, InternalTLS], spawn: Any, server: str) -> None:
    """Both HTTP servers of ``router.serving`` serve the plane's mTLS: a caller without the
    plane's certificate gets no HTTP answer, and a generate call goes through with one."""
    tls = pki["plane"]
    auth = InternalAuth(TOKEN, tls)
    worker = spawn("--worker-id", "w", "--require-token", TOKEN, "--tls", tls.ca, tls.cert, tls.key)
    cfg = RouterConfig(worker=(worker.url,), load_interval_s=0.1, health_interval_s=0.2, server=server)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    service = RouterService(cfg, router=Router(cfg, auth=auth), auth=auth)
    asyncio.run_coroutine_threadsafe(service.start("127.0.0.1", 0), loop).result(30)
    try:
        _check_mtls(service.port, pki)

        async def generate() -> None:
            client = WorkerClient(f"https://127.0.0.1:{service.port}", auth=auth)
            q = request(2, max_tokens=5)
            assert [t async for ev in client.generate(q) for t in ev.token_ids] == expected(q)
            await client.close()

        asyncio.run(generate())
    finally:
        asyncio.run_coroutine_threadsafe(service.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepserve_up_on_mtls(pki: dict[str, InternalTLS], tiny_model_dir: Path, tmp_path: Path) -> None:
    tls = pki["plane"]
    port = free_port()
    env = {**os.environ, "DEEPSERVE_KV_FS_FSYNC": "false"}
    cmd = [sys.executable, "-m", "deepserve.cli", "up", "--model", str(tiny_model_dir), "--port", str(port),
           "--cache-dir", str(tmp_path), "--dtype", "float32", "--engine-arg=--static-decode", "--engine-arg=off",
           "--internal-tls-ca", tls.ca, "--internal-tls-cert", tls.cert, "--internal-tls-key", tls.key]
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 500
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-3000:]
            try:
                model = oai.models.list().data[0].id
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        out = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1
        worker_port = int((tmp_path / "up.log").read_text().split("starting mixed-0 on port ")[1].split()[0])
        _check_mtls(worker_port, pki)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
