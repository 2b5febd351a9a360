"""Prometheus scrape config and the Grafana dashboard against the compose file and the metric contract.

The PromQL check is static: every metric name the dashboard queries must be a series the code
exposes (tests/deploy/contract.py), counters and histograms go through rate(), gauges do not, and
where a component's metrics module exists the family must be defined there. Scraping a live
stack is the later, stronger form of this test.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.deploy import compose_model as cm
from tests.deploy.contract import METRICS, ROOT, SERVING_SUBCOMMANDS, exposed_series, family_of

PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "deepserve.json"

# A metric name inside PromQL: starts a selector, not a function call, label or keyword.
_NAME = re.compile(r"(?<![\w:\"'{=~.$])((?:vllm:|deepserve_)[A-Za-z0-9_:]+)")


@pytest.fixture(scope="module")
def prom() -> dict[str, Any]:
    return yaml.safe_load(PROMETHEUS.read_text())


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets(job: dict[str, Any]) -> list[tuple[str, int]]:
    out = []
    for sc in job.get("static_configs", []):
        for t in sc["targets"]:
            host, port = t.rsplit(":", 1)
            out.append((host, int(port)))
    for dns in job.get("dns_sd_configs", []):
        out += [(n, int(dns["port"])) for n in dns["names"]]
    return out


def test_prometheus_scrapes_every_metrics_port_in_compose(prom: dict[str, Any]) -> None:
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    scraped = {t for j in jobs.values() for t in _targets(j)}
    for mode in (cm.active(cm.load()), cm.active(cm.load({"CPU_WORKERS": "0"}), profiles=("gpu",))):
        names = cm.hostnames(mode)
        serving = [s for s in mode.values() if (s.deepserve_args() or [""])[0] in SERVING_SUBCOMMANDS]
        assert {(s.flag("--role") or s.deepserve_args()[0]) for s in serving} == {"gateway", "router", "prefill", "decode"}
        for s in serving:
            port = int(s.flag("--port"))
            reachable = {(host, port) for host, svc in names.items() if svc == s.name}
            assert reachable & scraped, f"no scrape job for {s.name} on port {port}"
        for host, port in scraped:
            if host == "localhost":
                continue
            assert host in names and port in mode[names[host]].container_ports(), f"scrape target {host}:{port} does not exist"
    for job in ("gateway", "router", "prefill", "decode"):
        assert jobs[job].get("metrics_path", "/metrics") == "/metrics"


def test_compose_mounts_the_monitoring_config() -> None:
    svcs = cm.services(cm.load())
    prom_mounts = {(src, tgt) for src, tgt, _ in svcs["prometheus"].volumes()}
    assert ("./deploy/prometheus/prometheus.yml", "/etc/prometheus/prometheus.yml") in prom_mounts
    assert "--config.file=/etc/prometheus/prometheus.yml" in svcs["prometheus"].argv()
    graf = {src: tgt for src, tgt, _ in svcs["grafana"].volumes()}
    assert graf["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "deepserve.yml").read_text())
    (p,) = provider["providers"]
    assert p["options"]["path"] == graf["./deploy/grafana/dashboards"], "provider reads where compose mounts the dashboards"
    home = svcs["grafana"].environment()["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{p['options']['path']}/{DASHBOARD.name}"
    for src in graf:
        if src.startswith("./"):
            assert (ROOT / src).exists(), src


def test_grafana_datasource_matches_dashboard(dashboard: dict[str, Any]) -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    svcs = cm.services(cm.load())
    assert 9090 in svcs["prometheus"].container_ports()
    var = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert var["query"] == "prometheus" and var["current"]["value"] == source["uid"]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["definition"])
    return exprs


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"] == "deepserve"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
    # No two panels overlap.
    cells = set()
    for p in panels:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_dashboard_covers_the_operators_questions(dashboard: dict[str, Any]) -> None:
    exprs = "\n".join(_exprs(dashboard))
    need = {
        "throughput in/out": ["vllm:prompt_tokens_total", "vllm:generation_tokens_total"],
        "requests/s": ["deepserve_http_requests_total"],
        "TTFT percentiles": ["histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"],
        "ITL percentiles": ["histogram_quantile(0.5, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket"],
        "cache hit rate": ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"],
        "queue": ["vllm:num_requests_waiting", "vllm:num_requests_running"],
        "per-rank load": ["by (job, instance, dp_rank) (vllm:num_requests_running"],
        "KV tier usage": ["sum by (tier) (deepserve_kvstore_bytes_used)", "deepserve_kvstore_hits_total", "deepserve_kvstore_misses_total"],
        "errors": ['status=~"4.."', 'status=~"5.."', "deepserve_router_retries_total", "deepserve_router_migrations_total"],
    }  # fmt: skip
    for what, fragments in need.items():
        for frag in fragments:
            assert frag in exprs, f"dashboard lacks {what}: {frag}"


def test_every_dashboard_metric_is_exposed(dashboard: dict[str, Any]) -> None:
    series = exposed_series()
    for expr in _exprs(dashboard):
        names = _NAME.findall(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            assert name in series, f"{name!r} (in {expr!r}) is not a series deepserve exposes"
            _family, kind = series[name]
            ranged = re.search(re.escape(name) + r"(\{[^}]*\})?\[", expr) is not None
            if kind == "gauge":
                assert not ranged, f"rate() over the gauge {name}"
            elif name.endswith(("_total", "_bucket", "_count", "_sum")):
                assert ranged, f"{name} is cumulative: use rate()/increase()"
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr and "le" in expr, f"{name}: quantiles need `by (le)`"


def _source_names(package: str) -> set[str] | None:
    """Metric names defined as string literals in ``package``'s sources, or None if it defines none yet."""
    text = "\n".join(p.read_text(errors="replace") for p in (ROOT / package).rglob("*.py")) if (ROOT / package).exists() else ""
    found = set(re.findall(r"[\"']((?:vllm:|deepserve_)[A-Za-z0-9_:]+)[\"']", text))
    return {family_of(n) for n in found} or None


@pytest.mark.parametrize("owner", ["engine", "server", "router", "kvstore"])
def test_contract_matches_the_code(owner: str) -> None:
    """Once a component defines its metrics, every contracted family it owns must be defined there."""
    defined = _source_names(owner)
    if defined is None:
        pytest.skip(f"{owner}/ defines no metrics yet")
    missing = [f for f, (_, o) in METRICS.items() if o == owner and family_of(f) not in defined]
    assert not missing, f"{owner}/ does not define {missing} (rename in tests/deploy/contract.py and the dashboard together)"
