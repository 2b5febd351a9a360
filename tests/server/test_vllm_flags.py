"""The `vllm serve` flags on `deepserve up` / `gateway`: parsed into the config, passed to workers,
or refused; CORS from --allowed-origins through real HTTP."""

from __future__ import annotations

import httpx
import pytest

from deepserve.cli import build_parser
from server.config import GatewayConfig
from server.vllm_flags import check_vllm_flags, engine_args
from tests.server.conftest import MODEL


def test_vllm_spellings_reach_the_gateway_config():
    args = build_parser().parse_args([
        "gateway", "--engine-url", "http://w:1", "--served-model-name", "m", "--max-model-len", "4096",
        "--uvicorn-log-level", "warning", "--root-path", "/api", "--allowed-origins", '["https://a.example", "*"]',
        "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
        "--tool-call-parser", "deepseek_v31", "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
    ])
    check_vllm_flags(args)  # parser flags: accepted with a note
    cfg = GatewayConfig.from_args(args, env={})
    assert (cfg.max_model_len, cfg.log_level, cfg.root_path) == (4096, "warning", "/api")
    assert cfg.allowed_origins == ("https://a.example", "*")
    opts = cfg.uvicorn_options()
    assert (opts["root_path"], opts["ssl_keyfile"], opts["ssl_certfile"]) == ("/api", "k.pem", "c.pem")


def test_up_passes_engine_flags_to_workers():
    args = build_parser().parse_args([
        "up", "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.5",
        "--no-enable-prefix-caching",
    ])
    assert engine_args(args) == [
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.5", "--kv-cache", "off",
    ]
    assert engine_args(build_parser().parse_args(["up", "--enable-prefix-caching"])) == []
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    assert engine_args(build_parser().parse_args(["up", "--speculative-config", spec])) == ["--speculative-config", spec]


def test_up_worker_argv_carries_load_format_and_bounded_replay(tmp_path):
    from server.up import UpOptions, WorkerSet

    args = build_parser().parse_args(["up", "--load-format", "dummy", "--bounded-replay-tokens", "256"])
    forwarded = engine_args(args)
    assert forwarded == ["--load-format", "dummy", "--bounded-replay-tokens", "256"]
    cmd = WorkerSet(UpOptions(tmp_path, model_dir=tmp_path, engine_args=tuple(forwarded)), tmp_path).command("mixed", 1234)
    assert cmd[cmd.index("--load-format") + 1] == "dummy" and cmd[cmd.index("--bounded-replay-tokens") + 1] == "256"
    assert engine_args(build_parser().parse_args(["up"])) == []


def test_tensor_parallel_refused():
    with pytest.raises(SystemExit, match="tensor-parallel-size 2"):
        check_vllm_flags(build_parser().parse_args(["up", "-tp", "2"]))
    with pytest.raises(ValueError, match="ssl"):
        GatewayConfig(ssl_keyfile="k.pem")


def test_cors_from_allowed_origins(make_gateway):
    gw = make_gateway(allowed_origins=("https://app.example",))
    pre = httpx.options(gw.url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type",
    })
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                   headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(gw.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_engine_takes_the_vllm_spellings(capsys):
    from engine.cli import _engine

    args = build_parser().parse_args(["engine", "--model", "m", "--no-enable-prefix-caching", "-tp", "2", "--max-num-seqs", "4"])
    assert (args.enable_prefix_caching, args.max_num_seqs) == (False, 4)
    assert _engine(args) == 2 and "tensor-parallel-size 2" in capsys.readouterr().err
    for spec, says in (
        ('{"method": "eagle"}', "only 'mtp' or 'dspark'"),
        ('{"method": "dspark", "num_speculative_token": 3}', "unknown key(s) 'num_speculative_token'"),
        ('{"method": "dspark", "confidence_threshold": "high"}', "confidence_threshold must be int or float, got 'high'"),
        ('{"method": "dspark", "num_speculative_tokens": 2.5}', "num_speculative_tokens must be int"),
    ):
        bad = build_parser().parse_args(["engine", "--model", "m", "--speculative-config", spec])
        assert _engine(bad) == 2 and says in capsys.readouterr().err, spec
