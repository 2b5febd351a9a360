import pytest

from deepserve.cli import build_parser
from router.cli import config_from_args
from router.config import PolicyConfig, RouterConfig


def test_env_then_flags():
    env = {"DEEPSERVE_ROUTER_POLICY": "least_load", "DEEPSERVE_ROUTER_DECODE": "http://a:1, http://b:2", "DEEPSERVE_ROUTER_TEMPERATURE": "0.5", "DEEPSERVE_ROUTER_MAX_RETRIES": "7"}
    cfg = RouterConfig.from_env(env, max_retries=2)
    assert cfg.policy == "least_load" and cfg.decode == ("http://a:1", "http://b:2")
    assert cfg.policy_config.temperature == 0.5 and cfg.max_retries == 2


def test_cli_sub_command(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_ROUTER_POLICY", raising=False)
    args = build_parser().parse_args(["router", "--port", "9000", "--policy", "session_affinity", "--prefill", "http://p:1", "--decode", "http://d:1", "http://d:2", "--worker", "http://m:1"])
    cfg = config_from_args(args)
    assert (cfg.port, cfg.policy, cfg.prefill, cfg.decode, cfg.worker) == (9000, "session_affinity", ("http://p:1",), ("http://d:1", "http://d:2"), ("http://m:1",))
    assert callable(args.func)


def test_validation():
    with pytest.raises(ValueError):
        PolicyConfig(temperature=-1)
    with pytest.raises(ValueError):
        RouterConfig(block_size=0)


def test_server_switch(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_ROUTER_SERVER", raising=False)
    assert RouterConfig().server == "http1"  # the default stays ours
    assert RouterConfig.from_env({"DEEPSERVE_ROUTER_SERVER": "aiohttp"}).server == "aiohttp"
    assert config_from_args(build_parser().parse_args(["router", "--server", "aiohttp"])).server == "aiohttp"
    with pytest.raises(ValueError, match="server must be one of"):
        RouterConfig(server="nope")
