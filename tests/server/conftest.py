"""Fixtures: a gateway over the FAKE engine served by uvicorn in a thread (real HTTP, real
disconnects), and helpers shared by the gateway tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

import pytest
import uvicorn

from server.app import create_app
from server.config import GatewayConfig
from server.model import ModelCatalog
from tests.server.fake_engine import FakeEngine

MODEL = "DeepSeek-V4-Pro"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app: Any, **options: Any) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a daemon thread; yields the base URL.
    ``options``: more ``uvicorn.Config`` keywords (the gateway's HTTP protocol, ...)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test gateway did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def catalog() -> ModelCatalog:
    return ModelCatalog.load(GatewayConfig(served_model_names=(MODEL, "tiny-v41=v4")))


class Gateway:
    """A served app over a FakeEngine; ``url`` is the base URL."""

    def __init__(self, url: str, engine: FakeEngine, app: Any) -> None:
        self.url, self.engine, self.app = url, engine, app

    @property
    def state(self) -> Any:
        return self.app.state.gateway


@pytest.fixture
def make_gateway(catalog: ModelCatalog) -> Iterator[Any]:
    """``make_gateway(engine=None, **config)`` -> a running ``Gateway`` (stopped at teardown)."""
    stack = contextlib.ExitStack()

    def make(engine: FakeEngine | None = None, **config: Any) -> Gateway:
        engine = engine or FakeEngine()
        cfg = GatewayConfig(served_model_names=(MODEL, "tiny-v41=v4"), **config)
        app = create_app(cfg, engine, catalog=catalog)
        url = stack.enter_context(serve(app))
        return Gateway(url, engine, app)

    with stack:
        yield make


@pytest.fixture
def gateway(make_gateway: Any) -> Gateway:
    return make_gateway()


# ---- the live embedded stack (`deepserve up`) for the end-to-end tests ----------------------------
E2E_KEY = "sk-e2e-test"
E2E_LIMITED_KEY = "sk-e2e-limited"  # rpm=2 in the keys file
E2E_MODEL = "tiny-v4"
E2E_MAX_CONCURRENT = 4
E2E_MAX_BODY = 1 << 20
E2E_CONTEXT = 2048


def engine_missing_reason() -> str | None:
    """Why the live-stack tests cannot run yet (None: `deepserve engine` exists)."""
    import argparse
    import importlib

    try:
        engine_cli = importlib.import_module("engine.cli")
    except ImportError as exc:
        return f"`deepserve engine` is not available yet (engine.cli: {exc})"
    sub = argparse.ArgumentParser().add_subparsers()
    engine_cli.add_parser(sub)
    missing = {"engine", "make-tiny-model"} - set(sub.choices)
    return f"engine.cli lacks the sub-commands {sorted(missing)}" if missing else None


class LiveStack:
    def __init__(self, url: str, proc: Any) -> None:
        self.url, self.proc = url, proc


@contextlib.contextmanager
def run_up(args: list[str], log_dir: Any) -> Iterator[LiveStack]:
    """`deepserve up ARGS` as a subprocess on a free port; waits for /health; terminates at exit."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    port = free_port()
    log = open(log_dir / "up.log", "w+b")
    cmd = [sys.executable, "-m", "deepserve.cli", "up", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + float(os.environ.get("DEEPSERVE_E2E_STARTUP_S", "900"))
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"deepserve up exited with {proc.returncode}:\n{log.read().decode(errors='replace')[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("deepserve up did not become healthy in time")
            time.sleep(0.5)
        yield LiveStack(url, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    """The default embedded stack (tiny V4 checkpoint made by `deepserve up`) with API keys and limits."""
    reason = engine_missing_reason()
    if reason:
        pytest.skip(reason)
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{E2E_KEY}\n{E2E_LIMITED_KEY} rpm=2\n")
    args = [
        "--api-keys-file", str(keys), "--max-model-len", str(E2E_CONTEXT), "--max-body-bytes", str(E2E_MAX_BODY),
        "--max-concurrent-requests", str(E2E_MAX_CONCURRENT), "--max-queued-requests", "0",
    ]
    with run_up(args, tmp_path_factory.mktemp("up")) as stack:
        yield stack
