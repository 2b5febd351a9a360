"""Kubernetes manifests: every overlay renders with `kubectl kustomize` into objects that fit together.

Checked per rendering: kinds present, workload selectors match their pod labels, Services select a
workload and target its container ports, probes use declared ports, images are one deepserve
image per overlay, ConfigMap references resolve, the router lists exactly the worker pods the
StatefulSets create, and the ServiceMonitor finds every metrics Service.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from tests.deploy.contract import ROLES, ROOT, SERVING_SUBCOMMANDS, SUBCOMMANDS
from tests.deploy.k8s_render import EXTERNAL, KUBECTL

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (needed for `kubectl kustomize`)")

WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
COMPONENT_PORTS = {"gateway": 8000, "router": 8100, "prefill": 8200, "decode": 8201}


ALL = ["base", "dev", "gpu", EXTERNAL]


def _by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def _pod(o: dict[str, Any]) -> dict[str, Any]:
    return o["spec"]["template"]["spec"]


def _containers(o: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    pod = _pod(o)
    return list(pod.get("containers", [])) + (list(pod.get("initContainers") or []) if init else [])


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _deepserve_args(c: dict[str, Any]) -> list[str] | None:
    argv = list(c.get("command") or []) + list(c.get("args") or [])
    if argv[:2] == ["/bin/sh", "-c"]:
        argv = shlex.split(argv[2])
        if "deepserve" in argv:
            argv = argv[argv.index("deepserve") + 1 :]
        return [a for a in argv if a not in ("&&", "||")] or None
    return argv if c["image"].split("/")[-1].startswith("deepserve") else None


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _flag_values(args: list[str], name: str) -> list[str]:
    out: list[str] = []
    for i, tok in enumerate(args):
        if tok == name:
            for v in args[i + 1 :]:
                if v.startswith("--"):
                    break
                out.append(v)
    return out


def _component(o: dict[str, Any]) -> str:
    return o["metadata"]["labels"]["app.kubernetes.io/component"]


@pytest.mark.parametrize("name", ALL)
def test_expected_objects(rendered: dict, name: str) -> None:
    objs = rendered[name]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for want in [("Deployment", "gateway"), ("Deployment", "router"), ("StatefulSet", "prefill"), ("StatefulSet", "decode"),
                 ("Service", "gateway"), ("Service", "router"), ("Service", "prefill"), ("Service", "decode"),
                 ("ServiceMonitor", "deepserve"), ("ConfigMap", "deepserve-grafana-dashboard")]:  # fmt: skip
        assert want in kinds, f"{name}: missing {want}"
    has_redis = ("Deployment", "redis") in kinds and ("Service", "redis") in kinds
    assert has_redis == (name != EXTERNAL)
    assert [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("deepserve-config-")]
    for o in objs:
        assert o.get("apiVersion") and o.get("kind") and o["metadata"].get("name"), o
        if o["kind"] not in ("Namespace",):
            labels = o["metadata"].get("labels", {})
            assert "deepserve" in (labels.get("app.kubernetes.io/part-of"), labels.get("app.kubernetes.io/name")), (
                f"{o['kind']}/{o['metadata']['name']}"
            )
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    expected_ns = {"base": {None}, "dev": {"deepserve-dev"}, "gpu": {"deepserve"}, EXTERNAL: {"deepserve"}}[name]
    assert namespaces == expected_ns


@pytest.mark.parametrize("name", ALL)
def test_selectors_match_pod_labels(rendered: dict, name: str) -> None:
    for w in _workloads(rendered[name]):
        sel = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert _matches(sel, labels), f"{w['metadata']['name']}: selector {sel} vs labels {labels}"
    # No two workloads share pods.
    workloads = _workloads(rendered[name])
    for a in workloads:
        for b in workloads:
            if a is not b:
                assert not _matches(a["spec"]["selector"]["matchLabels"], b["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("name", ALL)
def test_services_target_container_ports(rendered: dict, name: str) -> None:
    objs = rendered[name]
    for svc in _by_kind(objs, "Service").values():
        targets = [w for w in _workloads(objs) if _matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        ports = {p["name"]: p["containerPort"] for c in _containers(targets[0], init=False) for p in c.get("ports", [])}
        for sp in svc["spec"]["ports"]:
            tp = sp.get("targetPort", sp["port"])
            resolved = ports.get(tp) if isinstance(tp, str) else tp
            assert resolved in ports.values(), f"Service {svc['metadata']['name']}: targetPort {tp} is no container port"
            assert sp["port"] == resolved, "Service port and container port are kept equal (one number per component)"


@pytest.mark.parametrize("name", ALL)
def test_probes_use_declared_ports(rendered: dict, name: str) -> None:
    for w in _workloads(rendered[name]):
        for c in _containers(w, init=False):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{c['name']}: probes missing"
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(probe_name)
                if not probe:
                    continue
                action = probe.get("httpGet") or probe.get("tcpSocket")
                if action is None:
                    assert "exec" in probe
                    continue
                port = action["port"]
                assert (ports.get(port) if isinstance(port, str) else port) in ports.values(), f"{c['name']} {probe_name}"
                if "httpGet" in probe:
                    assert probe["httpGet"]["path"] == "/health"
            if _component(w) in COMPONENT_PORTS:
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
                assert "startupProbe" in c


@pytest.mark.parametrize("name", ALL)
def test_one_deepserve_image_per_overlay(rendered: dict, name: str) -> None:
    images = {c["image"] for w in _workloads(rendered[name]) for c in _containers(w) if "deepserve" in c["image"]}
    assert len(images) == 1, images
    (image,) = images
    assert image.endswith({"gpu": ":0.1.0-cuda", EXTERNAL: ":0.1.0-cuda"}.get(name, ":0.1.0-cpu"))
    for w in _workloads(rendered[name]):
        for c in _containers(w):
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


@pytest.mark.parametrize("name", ALL)
def test_commands_use_real_subcommands(rendered: dict, name: str) -> None:
    for w in _workloads(rendered[name]):
        comp = _component(w)
        for c in _containers(w):
            args = _deepserve_args(c)
            if args is None:
                continue
            assert args[0] in SUBCOMMANDS, f"{comp}/{c['name']}: {args}"
            if args[0] in SERVING_SUBCOMMANDS:
                assert _flag(args, "--host") == "0.0.0.0"
                port = int(_flag(args, "--port"))
                assert port == COMPONENT_PORTS[comp]
                assert port in [p["containerPort"] for p in c["ports"]]
            if args[0] == "engine":
                assert _flag(args, "--role") == comp and comp in ROLES


@pytest.mark.parametrize("name", ALL)
def test_config_references_resolve(rendered: dict, name: str) -> None:
    objs = rendered[name]
    configmaps = _by_kind(objs, "ConfigMap")
    pvcs = _by_kind(objs, "PersistentVolumeClaim")
    services = _by_kind(objs, "Service")
    for w in _workloads(objs):
        pod = _pod(w)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(w):
            for ef in c.get("envFrom", []):
                assert ef["configMapRef"]["name"] in configmaps
            for vm in c.get("volumeMounts", []):
                assert vm["name"] in volumes, f"{w['metadata']['name']}/{c['name']}: no volume {vm['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
            assert sum(k in v for k in ("emptyDir", "persistentVolumeClaim", "configMap", "secret")) == 1, v
    # The workers' Redis URL names the in-cluster Service, unless the external component replaced it.
    (cfg,) = [c for n, c in configmaps.items() if n.startswith("deepserve-config-")]
    host = cfg["data"]["DEEPSERVE_KV_REDIS_URL"].split("://", 1)[1].split(":")[0]
    assert (host in services) == (name != EXTERNAL)


@pytest.mark.parametrize("name", ALL)
def test_kv_config_fits_the_volumes(rendered: dict, name: str) -> None:
    objs = rendered[name]
    (cfg,) = [c for n, c in _by_kind(objs, "ConfigMap").items() if n.startswith("deepserve-config-")]
    data = cfg["data"]
    for sts in _by_kind(objs, "StatefulSet").values():
        engine = _containers(sts, init=False)[0]
        mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
        assert data["DEEPSERVE_KV_SSD_DIR"] in mounts
        ssd = next(v for v in _pod(sts)["volumes"] if v["name"] == mounts[data["DEEPSERVE_KV_SSD_DIR"]])
        assert _bytes(data["DEEPSERVE_KV_SSD_BYTES"]) < _bytes(ssd["emptyDir"]["sizeLimit"])
        assert _bytes(data["DEEPSERVE_KV_MEMORY_BYTES"]) < _bytes(engine["resources"]["limits"]["memory"])
    config = pytest.importorskip("kvstore.config", reason="kvstore/config.py not written yet")
    cfg_obj = config.KVStoreConfig.from_env(data)
    assert "ssd" in cfg_obj.tiers and cfg_obj.ssd_dir == data["DEEPSERVE_KV_SSD_DIR"]


def _bytes(text: str) -> int:
    units = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "KiB": 1 << 10, "MiB": 1 << 20,
             "GiB": 1 << 30, "TiB": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # fmt: skip
    num = text.rstrip("KMGTikB")
    return int(float(num) * units[text[len(num) :]])


@pytest.mark.parametrize("name", ALL)
def test_router_lists_every_worker_pod(rendered: dict, name: str) -> None:
    objs = rendered[name]
    sts = _by_kind(objs, "StatefulSet")
    services = _by_kind(objs, "Service")
    router = _containers(_by_kind(objs, "Deployment")["router"], init=False)[0]
    args = _deepserve_args(router)
    for role in ("prefill", "decode"):
        s = sts[role]
        svc = services[s["spec"]["serviceName"]]
        assert svc["spec"].get("clusterIP") == "None", "a StatefulSet's governing Service must be headless"
        assert _matches(svc["spec"]["selector"], s["spec"]["template"]["metadata"]["labels"])
        port = svc["spec"]["ports"][0]["port"]
        want = [f"http://{role}-{i}.{svc['metadata']['name']}:{port}" for i in range(s["spec"].get("replicas", 1))]
        assert _flag_values(args, f"--{role}") == want, f"{name}: router's --{role} vs {s['spec'].get('replicas', 1)} pods"
    gateway = _containers(_by_kind(objs, "Deployment")["gateway"], init=False)[0]
    router_port = services["router"]["spec"]["ports"][0]["port"]
    assert _flag(_deepserve_args(gateway), "--engine-url") == f"http://router:{router_port}"


@pytest.mark.parametrize("name", ALL)
def test_model_directory(rendered: dict, name: str) -> None:
    """Gateway and workers read --model from the `models` volume; tiny model made in place on CPU
    overlays, the checkpoint PVC (read-only, no init container) on the gpu overlay."""
    gpu = name in ("gpu", EXTERNAL)
    for w in _workloads(rendered[name]):
        if _component(w) not in ("gateway", "prefill", "decode"):
            continue
        main = _containers(w, init=False)[0]
        model = _flag(_deepserve_args(main), "--model")
        assert {"name": "models", "mountPath": model, "readOnly": True} in main["volumeMounts"]
        vol = next(v for v in _pod(w)["volumes"] if v["name"] == "models")
        inits = _pod(w).get("initContainers") or []
        if gpu:
            assert vol["persistentVolumeClaim"]["readOnly"] is True and not inits
        else:
            assert "emptyDir" in vol
            (init,) = inits
            assert _deepserve_args(init)[:3] == ["make-tiny-model", "--out", model]


@pytest.mark.parametrize("name", ALL)
def test_gpu_requests(rendered: dict, name: str) -> None:
    gpu = name in ("gpu", EXTERNAL)
    for w in _workloads(rendered[name]):
        for c in _containers(w, init=False):
            res = c.get("resources", {})
            req = res.get("requests", {}).get("nvidia.com/gpu")
            lim = res.get("limits", {}).get("nvidia.com/gpu")
            assert req == lim, "extended resources need requests == limits"
            if gpu and _component(w) in ("prefill", "decode"):
                args = _deepserve_args(c)
                assert int(req) >= 1 and _flag(args, "--device") == "cuda"
                assert int(_flag(args, "--dp") or 1) <= int(req), "more DP ranks than GPUs"
                assert any(t.get("key") == "nvidia.com/gpu" for t in _pod(w).get("tolerations", []))
            else:
                assert req is None
                if _component(w) in ("prefill", "decode"):
                    assert _flag(_deepserve_args(c), "--device") == "cpu"
            assert res.get("requests", {}).get("memory") and res.get("limits", {}).get("memory"), f"{c['name']}: memory"


@pytest.mark.parametrize("name", ALL)
def test_pods_run_as_non_root(rendered: dict, name: str) -> None:
    for w in _workloads(rendered[name]):
        assert _pod(w)["securityContext"]["runAsNonRoot"] is True
        for c in _containers(w):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("name", ALL)
def test_servicemonitor_selects_every_metrics_service(rendered: dict, name: str) -> None:
    objs = rendered[name]
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    sel = sm["spec"]["selector"]

    def selected(svc: dict[str, Any]) -> bool:
        labels = svc["metadata"]["labels"]
        if not all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()):
            return False
        for expr in sel.get("matchExpressions", []):
            assert expr["operator"] == "In"
            if labels.get(expr["key"]) not in expr["values"]:
                return False
        return True

    chosen = {n: s for n, s in _by_kind(objs, "Service").items() if selected(s)}
    assert set(chosen) == set(COMPONENT_PORTS), "ServiceMonitor must scrape gateway, router and both worker pools (not Redis)"
    for ep in sm["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        for svc in chosen.values():
            assert ep["port"] in [p["name"] for p in svc["spec"]["ports"]], f"{svc['metadata']['name']} has no port {ep['port']}"
    assert sm["spec"]["jobLabel"] in next(iter(chosen.values()))["metadata"]["labels"]


@pytest.mark.parametrize("name", ALL)
def test_dashboard_configmap_is_the_dashboard_file(rendered: dict, name: str) -> None:
    cm = _by_kind(rendered[name], "ConfigMap")["deepserve-grafana-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    on_disk = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "deepserve.json").read_text())
    assert json.loads(cm["data"]["deepserve.json"]) == on_disk


def test_replica_counts(rendered: dict) -> None:
    def replicas(name: str, kind: str, obj: str) -> int:
        return _by_kind(rendered[name], kind)[obj]["spec"].get("replicas", 1)

    assert replicas("dev", "Deployment", "gateway") == 1
    assert replicas("base", "Deployment", "gateway") == 2
    assert (replicas("gpu", "StatefulSet", "prefill"), replicas("gpu", "StatefulSet", "decode")) == (1, 2)
    for name in ALL:
        assert replicas(name, "Deployment", "router") == 1


@pytest.mark.parametrize("name", ALL)
def test_internal_token_secret_reaches_every_deepserve_pod(rendered: dict, name: str) -> None:
    """Gateway, router and workers read the token from the Secret; the ServiceMonitor sends it;
    the base leaves it empty (router and workers refuse to start until an overlay sets it)."""
    objs = rendered[name]
    (secret,) = _by_kind(objs, "Secret").values()
    assert secret["metadata"]["name"] == "deepserve-internal-token"
    assert (secret.get("data") or {}).get("token", "") != "" if name == "dev" else (secret.get("data") or {}).get("token", "") == ""
    for o in _workloads(objs):
        if _component(o) == "redis":
            continue
        (c,) = [c for c in _containers(o, init=False) if _deepserve_args(c)]
        assert {"name": "DEEPSERVE_INTERNAL_TOKEN_FILE", "value": "/run/deepserve/token"} in c.get("env", []), o["metadata"]["name"]
        assert {"name": "internal-token", "mountPath": "/run/deepserve", "readOnly": True} in c["volumeMounts"]
        vols = {v["name"]: v for v in _pod(o)["volumes"]}
        assert vols["internal-token"]["secret"]["secretName"] == "deepserve-internal-token"
    for sm in _by_kind(objs, "ServiceMonitor").values():
        for ep in sm["spec"]["endpoints"]:
            assert ep["authorization"]["credentials"] == {"name": "deepserve-internal-token", "key": "token"}


@pytest.mark.parametrize("name", ALL)
def test_network_policies_admit_only_the_request_path(rendered: dict, name: str) -> None:
    objs = rendered[name]
    pols = _by_kind(objs, "NetworkPolicy")
    deny = pols["deepserve-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    assert deny["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "deepserve"}

    def sources(pol: str) -> list[dict[str, Any]]:
        return [f for rule in pols[pol]["spec"]["ingress"] for f in rule.get("from", [])]

    assert sources("deepserve-gateway") == []  # anyone may reach the gateway
    router_from = [f["podSelector"]["matchLabels"] for f in sources("deepserve-router") if "namespaceSelector" not in f]
    assert router_from == [{"app.kubernetes.io/name": "deepserve", "app.kubernetes.io/component": "gateway"}]
    worker_from = [f["podSelector"]["matchLabels"] for f in sources("deepserve-workers") if "namespaceSelector" not in f]
    assert worker_from == [{"app.kubernetes.io/name": "deepserve", "app.kubernetes.io/component": "router"}]
    pods = {_component(o): o["spec"]["template"]["metadata"]["labels"] for o in _workloads(objs)}
    for comp in ("prefill", "decode"):
        assert pods[comp]["app.kubernetes.io/component"] in pols["deepserve-workers"]["spec"]["podSelector"]["matchExpressions"][1]["values"]
