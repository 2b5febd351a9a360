"""Fixtures of the bench tests: fake workers as real processes on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from bench import procs


@pytest.fixture
def start_fake_worker() -> Iterator[Callable[..., str]]:
    """``start_fake_worker("--ttft", "0.2", ...)`` -> base URL; stopped after the test."""
    started = []

    def start(*args: str) -> str:
        port = procs.free_port()
        proc = procs.start(procs.fake_worker_cmd(port, *args), f"http://127.0.0.1:{port}/health", timeout=30)
        started.append(proc)
        return f"http://127.0.0.1:{port}"

    yield start
    for p in started:
        procs.stop(p)


@pytest.fixture
def two_model_gateway() -> Iterator[str]:
    """A real gateway (over the FAKE engine) serving the names ``served-first`` and ``other``."""
    from server.app import create_app
    from server.config import GatewayConfig
    from tests.server.conftest import serve
    from tests.server.fake_engine import FakeEngine

    app = create_app(GatewayConfig(served_model_names=("served-first", "other")), FakeEngine())
    with serve(app) as url:
        yield url
