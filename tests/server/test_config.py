"""GatewayConfig: defaults < DEEPSERVE_* environment < CLI flags; validation on creation."""

from __future__ import annotations

import argparse

import pytest

from server.config import GatewayConfig, add_gateway_flags, parse_served_name


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_gateway_flags(p)
    return p.parse_args(argv)


def test_precedence_env_then_flags():
    env = {"DEEPSERVE_PORT": "9000", "DEEPSERVE_API_KEY": "a,b", "DEEPSERVE_RATE_LIMIT_RPM": "60", "DEEPSERVE_DEFAULT_THINKING": "false"}
    cfg = GatewayConfig.from_args(parse(["--port", "9100", "--served-model-name", "x", "y=v4.1"]), env)
    assert cfg.port == 9100  # flag wins
    assert cfg.api_keys == ("a", "b") and cfg.rate_limit_rpm == 60 and cfg.default_thinking is False
    assert cfg.served_model_names == ("x", "y=v4.1")
    assert GatewayConfig.from_args(parse([]), {}).port == 8000


def test_validation():
    with pytest.raises(ValueError):
        GatewayConfig(port=0)
    with pytest.raises(ValueError):
        GatewayConfig(max_body_bytes=0)
    with pytest.raises(ValueError):
        GatewayConfig(served_model_names=("x=v5",))
    with pytest.raises(ValueError):
        GatewayConfig.from_env({"DEEPSERVE_DEFAULT_THINKING": "maybe"})


def test_served_names_and_keys_file(tmp_path):
    assert parse_served_name("m", "v4") == ("m", "v4")
    assert parse_served_name("m=V4.1", "v4") == ("m", "v4.1")
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-1 rpm=5  # alice\n\nsk-2 tpm=100 rpm=1\nsk-3\n")
    cfg = GatewayConfig(api_keys=("sk-0",), api_keys_file=str(keys))
    assert cfg.all_api_keys() == {"sk-0", "sk-1", "sk-2", "sk-3"}
    assert cfg.key_limits() == {"sk-1": (5, None), "sk-2": (1, 100), "sk-3": (None, None)}
    keys.write_text("sk-1 alice\n")
    with pytest.raises(ValueError):
        cfg.key_limits()
    served = GatewayConfig(served_model_names=("a", "b=v4.1")).served_models("v4", ("default",))
    assert [(m.name, m.family) for m in served] == [("a", "v4"), ("b", "v4.1")]
