"""``--request-timeout`` holds for streams: an engine that goes silent mid-stream gets the
client a timeout error event at the deadline, then the stream closes and the request is aborted."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from deepserve.protocol import TokenEvent
from tests.server.conftest import MODEL
from tests.server.fake_engine import FakeEngine


class SilentEngine(FakeEngine):
    """Two tokens, then nothing at all (a hung worker behind a router without deadlines)."""

    async def generate(self, req):  # noqa: ANN001
        self.requests.append(req)
        yield TokenEvent(req.request_id, [19923], num_prompt_tokens=len(req.prompt_token_ids))
        yield TokenEvent(req.request_id, [2058])
        await asyncio.sleep(3600)


def test_a_silent_stream_ends_with_a_timeout_event_at_the_deadline(make_gateway) -> None:
    gw = make_gateway(SilentEngine(), request_timeout_s=1.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        frames = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - t0
    assert 0.9 < took < 5, took
    errors = [json.loads(f)["error"] for f in frames if f != "[DONE]" and "error" in json.loads(f)]
    assert errors and errors[-1]["code"] == "timeout"
    deadline = time.monotonic() + 5
    while not gw.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.engine.aborted
