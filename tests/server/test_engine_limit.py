"""The gateway's context length is its engine's (``server/engine_limit.py``): learned from the
engine's ``/load`` report, a larger ``--max-model-len`` clamped to it, a smaller one kept."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from server.app import create_app
from server.config import GatewayConfig
from server.engine_limit import adopted
from tests.server.conftest import MODEL, serve
from tests.server.fake_engine import FakeEngine


def test_adopted_length(catalog: Any) -> None:
    assert adopted(catalog, None, 1024).context_len == 1024
    assert adopted(catalog, 100_000, 1024).context_len == 1024  # clamped to what the engine takes
    assert adopted(catalog, 512, 1024).context_len == 512  # the operator's smaller limit kept
    assert adopted(catalog, None, catalog.context_len) is catalog


def test_gateway_learns_the_engines_length_once_it_answers(catalog: Any) -> None:
    answers = iter([ConnectionError("not up"), 0, 1024])

    async def probe() -> int:
        await asyncio.sleep(0)
        answer = next(answers, 1024)
        if isinstance(answer, Exception):
            raise answer
        return answer

    app = create_app(GatewayConfig(served_model_names=(MODEL,)), FakeEngine(), catalog=catalog, context_probe=probe)
    with serve(app) as url:
        deadline = time.time() + 10
        while httpx.get(f"{url}/v1/models/{MODEL}").json()["max_model_len"] != 1024:
            assert time.time() < deadline, "the engine's length was not learned"
            time.sleep(0.1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 1100}]}
        got = httpx.post(url + "/v1/chat/completions", json=body)
        assert got.status_code == 400 and got.json()["error"]["code"] == "context_length_exceeded"
