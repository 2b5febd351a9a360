"""Two ``deepserve gateway --engine-url`` processes in front of one real worker, sharing one valkey:
each learns the worker's context length (one given a larger ``--max-model-len`` is clamped), a
request without ``max_tokens`` is sized to fit rather than refused, and a Response stored through
one gateway is read, continued and deleted through the other."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.integration.workers import TOKEN, free_port, start_workers

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(300)]
ENGINE_LEN = 512
SERVED = "tiny"


@contextlib.contextmanager
def gateway(engine_url: str, model_dir: Any, redis_url: str, prefix: str, log_dir: Any, *extra: str) -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, DEEPSERVE_INTERNAL_TOKEN=TOKEN, DEEPSERVE_KV_REDIS_URL=redis_url, DEEPSERVE_RESPONSES_REDIS_PREFIX=prefix)
    cmd = [sys.executable, "-m", "deepserve.cli", "gateway", "--engine-url", engine_url, "--model", str(model_dir), "--port", str(port),
           "--served-model-name", SERVED, "--default-thinking", "false", "--responses-store", "redis", "--log-level", "warning", *extra]
    with open(log_dir / f"gateway-{port}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 60
            while True:  # until it serves the engine's length (learned from the worker's /load)
                assert proc.poll() is None and time.time() < deadline, (log_dir / f"gateway-{port}.log").read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models/{SERVED}", timeout=2).json().get("max_model_len") == ENGINE_LEN:
                        break
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.fixture(scope="module")
def gateways(tiny_model_dir: Any, redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("logs")
    (worker,) = start_workers(tiny_model_dir, tmp_path_factory.mktemp("kv"), ["mixed"], logs, extra=("--max-model-len", str(ENGINE_LEN)))
    prefix = f"test-gateways-{uuid.uuid4().hex[:8]}"
    try:
        with gateway(worker.url, tiny_model_dir, redis_server.url, prefix, logs) as a, \
                gateway(worker.url, tiny_model_dir, redis_server.url, prefix, logs, "--max-model-len", "1000000") as b:
            yield a, b
    finally:
        worker.terminate()


def test_a_default_max_tokens_is_sized_to_the_engines_context(gateways: tuple[str, str]) -> None:
    for url in gateways:  # b was told 1,000,000: clamped to the engine's 512
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=SERVED, prompt=list(range(1000, 1480)), temperature=0)  # no max_tokens
        assert r.usage.prompt_tokens == 480 and r.usage.completion_tokens <= ENGINE_LEN - 480
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=SERVED, prompt=list(range(1000, 1600)), max_tokens=1)
        assert err.value.code == "context_length_exceeded"


def test_a_response_stored_through_one_gateway_is_served_by_the_other(gateways: tuple[str, str]) -> None:
    a, b = (openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) for url in gateways)
    first = a.responses.create(model=SERVED, input="Hello there.", max_output_tokens=6, temperature=0)
    assert b.responses.retrieve(first.id).output_text == first.output_text
    second = b.responses.create(model=SERVED, input="Again.", previous_response_id=first.id, max_output_tokens=6, temperature=0)
    items = [i.id for i in a.responses.input_items.list(second.id).data]
    assert len(items) >= 3  # the first turn's input and output, then this one's input
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
