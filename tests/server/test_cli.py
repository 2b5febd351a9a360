"""`deepserve gateway` / `deepserve up` wiring: flag parsing, and a real gateway process in front of
a FAKE worker (the bench's, speaking the worker HTTP surface)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from deepserve.cli import build_parser
from server.config import GatewayConfig
from server.up import UpOptions
from tests.server.conftest import free_port


def test_parsers():
    args = build_parser().parse_args([
        "gateway", "--engine-url", "http://w:1", "--port", "9001", "--served-model-name", "a", "b=v4.1",
        "--api-key", "k1", "--api-key", "k2", "--rate-limit-rpm", "5",
    ])
    cfg = GatewayConfig.from_args(args, env={})
    assert (cfg.engine_url, cfg.port, cfg.served_model_names, cfg.api_keys, cfg.rate_limit_rpm) == ("http://w:1", 9001, ("a", "b=v4.1"), ("k1", "k2"), 5)
    up = build_parser().parse_args(["up", "--prefill-workers", "2", "--decode-workers", "1", "--dtype", "float32"])
    assert (up.prefill_workers, up.decode_workers, up.dtype) == (2, 1, "float32")


def test_up_options(tmp_path):
    assert UpOptions(tmp_path).roles() == ["mixed"]
    assert UpOptions(tmp_path, prefill_workers=2, decode_workers=1).roles() == ["prefill", "prefill", "decode"]
    assert UpOptions(tmp_path).checkpoint == tmp_path / "tiny-v4"
    with pytest.raises(ValueError):
        UpOptions(tmp_path, prefill_workers=1)
    assert UpOptions.default_cache_dir({"DEEPSERVE_CACHE_DIR": str(tmp_path)}) == tmp_path


def test_up_passes_one_context_length_to_every_worker(tmp_path):
    from server.up import WorkerSet

    cmd = WorkerSet(UpOptions(tmp_path, max_model_len=4096), tmp_path).command("mixed", 9000)
    assert cmd[cmd.index("--max-model-len") + 1] == "4096"
    assert "--max-model-len" not in WorkerSet(UpOptions(tmp_path), tmp_path).command("mixed", 9000)


def test_gateway_process_over_fake_worker():
    wport, gport = free_port(), free_port()
    worker = subprocess.Popen([sys.executable, "-m", "bench.gateway_bench", "--fake-worker", "--port", str(wport)])
    gateway = subprocess.Popen([
        sys.executable, "-m", "deepserve.cli", "gateway", "--engine-url", f"http://127.0.0.1:{wport}",
        "--port", str(gport), "--served-model-name", "m", "--log-level", "warning",
    ])
    url = f"http://127.0.0.1:{gport}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "gateway did not become healthy"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "thinking": {"type": "disabled"},
        })
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        gateway.send_signal(signal.SIGTERM)
        worker.terminate()
        assert gateway.wait(20) in (0, -signal.SIGTERM)
        worker.wait(20)
