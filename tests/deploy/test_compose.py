"""docker-compose.yml: valid against the Compose schema, and consistent with itself and the CLI.

No Docker engine (and no Compose plugin) runs on these machines, so the file is checked against
the Compose Specification's JSON schema (vendored beside this file, see compose-spec.NOTICE) and,
where ``docker compose`` happens to work without a daemon, with ``docker compose config`` too.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from tests.deploy import compose_model as cm
from tests.deploy.contract import ROLES, ROOT, SERVING_SUBCOMMANDS, SUBCOMMANDS

SCHEMA = Path(__file__).with_name("compose-spec.json")

EXPECTED_SERVICES = {
    "model-init", "redis", "prefill", "decode", "prefill-gpu", "decode-gpu", "router", "gateway", "prometheus", "grafana",
}  # fmt: skip
# Variants of one logical service: the gpu profile's workers stand in for the CPU ones.
GPU_TWINS = {"prefill-gpu": "prefill", "decode-gpu": "decode"}
GPU_MODE_ENV = {"CPU_WORKERS": "0"}


@pytest.fixture(scope="module")
def raw() -> dict:
    return cm.load_raw()


@pytest.fixture(scope="module")
def compose() -> dict:
    return cm.load()


@pytest.fixture(scope="module")
def svcs(compose: dict) -> dict[str, cm.Service]:
    return cm.services(compose)


def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    return jsonschema.Draft7Validator(schema)


def test_schema_accepts_the_file_before_and_after_interpolation(raw: dict, compose: dict) -> None:
    validator = _validator()
    for label, doc in (("raw", raw), ("defaults", compose), ("gpu", cm.load(GPU_MODE_ENV))):
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{label}: " + "\n".join(errors)


def test_schema_rejects_a_misspelt_key(raw: dict) -> None:
    """The schema is strict (unknown keys fail), so passing it means something."""
    bad = copy.deepcopy(raw)
    bad["services"]["gateway"]["healthchek"] = bad["services"]["gateway"].pop("healthcheck")
    assert list(_validator().iter_errors(bad))


def _docker_compose_works() -> bool:
    if not shutil.which("docker"):
        return False
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=20, check=False)
    return r.returncode == 0


@pytest.mark.skipif(not _docker_compose_works(), reason="`docker compose` (the Compose plugin) is not installed here")
@pytest.mark.parametrize("profile_args", [[], ["--profile", "gpu"]])
def test_docker_compose_config(profile_args: list[str]) -> None:
    r = subprocess.run(
        ["docker", "compose", "-f", str(cm.COMPOSE_FILE), *profile_args, "config", "--quiet"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_expected_services(svcs: dict[str, cm.Service]) -> None:
    assert set(svcs) == EXPECTED_SERVICES


def test_default_and_gpu_modes_start_the_right_services(compose: dict) -> None:
    default = set(cm.active(compose))
    assert default == EXPECTED_SERVICES - set(GPU_TWINS)
    gpu = set(cm.active(cm.load(GPU_MODE_ENV), profiles=("gpu",)))
    assert gpu == EXPECTED_SERVICES - set(GPU_TWINS.values())


def test_every_deepserve_service_runs_a_real_subcommand(svcs: dict[str, cm.Service]) -> None:
    for s in svcs.values():
        if not s.is_deepserve:
            continue
        args = s.deepserve_args()
        assert args, f"{s.name}: command runs no `deepserve` sub-command: {s.argv()}"
        assert args[0] in SUBCOMMANDS, f"{s.name}: unknown sub-command {args[0]!r}"
        if args[0] == "engine":
            assert s.flag("--role") in ROLES, f"{s.name}: --role {s.flag('--role')!r}"
            assert s.flag("--role") == (GPU_TWINS.get(s.name) or s.name), f"{s.name} runs the wrong role"


def test_serving_services_bind_all_interfaces_on_their_exposed_port(svcs: dict[str, cm.Service]) -> None:
    for s in svcs.values():
        args = s.deepserve_args() or []
        if not args or args[0] not in SERVING_SUBCOMMANDS:
            continue
        assert s.flag("--host") == "0.0.0.0", f"{s.name} must listen on all interfaces in a container"
        port = int(s.flag("--port") or 0)
        assert s.container_ports() == [port], f"{s.name}: exposes {s.container_ports()}, listens on {port}"


def test_container_ports_are_distinct_across_services(compose: dict) -> None:
    """Distinct ports let the topology run as plain processes on one host (and with host networking)."""
    for mode in (cm.active(compose), cm.active(cm.load(GPU_MODE_ENV), profiles=("gpu",))):
        seen: dict[int, str] = {}
        for s in mode.values():
            for p in s.container_ports():
                assert p not in seen, f"port {p} used by {seen[p]} and {s.name}"
                seen[p] = s.name


def test_gpu_twins_match_their_cpu_service(svcs: dict[str, cm.Service]) -> None:
    for gpu_name, cpu_name in GPU_TWINS.items():
        gpu, cpu = svcs[gpu_name], svcs[cpu_name]
        assert gpu.profiles == ["gpu"] and not cpu.profiles
        assert cpu_name in gpu.aliases(), f"{gpu_name} must answer to {cpu_name!r} on the network"
        assert gpu.container_ports() == cpu.container_ports()
        assert gpu.flag("--device") == "cuda" and cpu.flag("--device") == "cpu"
        strip = lambda a: [x for i, x in enumerate(a) if x not in ("--device", "--dp") and a[i - 1] not in ("--device", "--dp")]
        assert strip(gpu.deepserve_args()) == strip(cpu.deepserve_args()), f"{gpu_name} differs from {cpu_name} beyond the device"
        assert gpu.environment() == cpu.environment()
        assert gpu.volumes() == cpu.volumes()
        devices = gpu.spec["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
        assert gpu.spec["build"]["args"]["VARIANT"] == "cuda" and cpu.spec["build"]["args"]["VARIANT"] == "cpu"
    # The two GPU workers must not land on the same default device.
    ids = {n: svcs[n].spec["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0] for n in GPU_TWINS}
    assert len(set(ids.values())) == len(ids), ids


def test_healthchecks_and_start_order(svcs: dict[str, cm.Service]) -> None:
    order = cm.start_order(svcs)  # raises on a cycle
    for s in svcs.values():
        one_shot = s.spec.get("restart") == "no"
        if not one_shot:
            assert s.healthcheck_argv(), f"{s.name} has no healthcheck"
        for dep, cond in s.depends_on().items():
            assert dep in svcs, f"{s.name} depends on unknown {dep}"
            assert order.index(dep) < order.index(s.name)
            target = svcs[dep]
            if cond["condition"] == "service_healthy":
                assert target.healthcheck_argv(), f"{s.name} waits for {dep} to be healthy, which has no healthcheck"
            if cond["condition"] == "service_completed_successfully":
                assert target.spec.get("restart") == "no", f"{dep} must be a one-shot service"
            # Only profile-gated services may be optional dependencies.
            assert cond["required"] or target.profiles, f"{s.name} -> {dep}: required: false on an always-on service"
            assert not target.profiles or not cond["required"], f"{s.name} -> {dep}: a gpu-only service must be optional"


def test_request_path_start_order(svcs: dict[str, cm.Service]) -> None:
    """gateway waits for router, router for both worker pools, workers for the model and Redis."""
    healthy = lambda s: {d for d, c in svcs[s].depends_on().items() if c["condition"] == "service_healthy"}
    assert "router" in healthy("gateway")
    assert {"prefill", "decode", "prefill-gpu", "decode-gpu"} <= healthy("router")
    for w in ("prefill", "decode", *GPU_TWINS):
        deps = svcs[w].depends_on()
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["model-init"]["condition"] == "service_completed_successfully"
    assert "prometheus" in healthy("grafana")


def test_healthchecks_probe_the_service_own_port(svcs: dict[str, cm.Service]) -> None:
    for s in svcs.values():
        hc = s.healthcheck_argv()
        if not hc:
            continue
        urls = [m for a in hc for m in cm.URL_RE.finditer(a)]
        ports = [int(m["port"]) for m in urls] + [int(hc[i + 1]) for i, a in enumerate(hc[:-1]) if a == "-p"]
        assert ports, f"{s.name}: healthcheck names no port: {hc}"
        for p in ports:
            assert p in s.container_ports(), f"{s.name}: healthcheck probes {p}, service exposes {s.container_ports()}"
        for m in urls:
            assert m["host"] in ("127.0.0.1", "localhost"), f"{s.name}: healthcheck must probe its own container"
        if s.is_deepserve:
            assert hc[0] == "deepserve-healthcheck" and hc[1].endswith("/health"), hc


def test_urls_between_services_resolve(compose: dict) -> None:
    """Every http://host:port in commands and environments names a service (or alias) exposing that port."""
    for mode in (cm.active(compose), cm.active(cm.load(GPU_MODE_ENV), profiles=("gpu",))):
        names = cm.hostnames(mode)
        for s in mode.values():
            texts = list(s.argv()) + list(s.environment().values())
            for text in texts:
                for m in cm.URL_RE.finditer(text):
                    host, port = m["host"], int(m["port"])
                    if host in ("127.0.0.1", "localhost", "0.0.0.0"):
                        continue
                    assert host in names, f"{s.name}: {m.group(0)} names no service"
                    assert port in mode[names[host]].container_ports(), f"{s.name}: {m.group(0)} is not an exposed port"


def test_router_and_gateway_wiring(svcs: dict[str, cm.Service]) -> None:
    router, gateway = svcs["router"], svcs["gateway"]
    assert router.flag_values("--prefill") == [f"http://prefill:{svcs['prefill'].flag('--port')}"]
    assert router.flag_values("--decode") == [f"http://decode:{svcs['decode'].flag('--port')}"]
    assert gateway.flag("--engine-url") == f"http://router:{router.flag('--port')}"
    assert router.flag("--policy") == "cache_aware"


def test_model_volume_and_model_dir(svcs: dict[str, cm.Service]) -> None:
    """Everything that reads the model mounts the same source at its --model path; only model-init writes."""
    for env, expect_src in (({}, "models"), ({"MODEL_DIR": "/data/ckpt"}, "/data/ckpt")):
        mode = cm.services(cm.load(env))
        init = mode["model-init"]
        assert (expect_src, "/models", False) in init.volumes()
        assert "deepserve make-tiny-model --out /models" in init.argv()[-1]
        assert "test -f /models/config.json" in init.argv()[-1], "a real checkpoint must be left alone"
        for s in mode.values():
            model = s.flag("--model")
            if model is None:
                continue
            assert (expect_src, model, True) in s.volumes(), f"{s.name}: --model {model} is not the read-only model volume"
    assert "models" in cm.load()["volumes"]


def test_kv_store_environment(svcs: dict[str, cm.Service]) -> None:
    workers = [s for s in svcs.values() if (s.deepserve_args() or [""])[0] == "engine"]
    assert len(workers) == 4
    for s in workers:
        env = s.environment()
        assert env["DEEPSERVE_KV_TIERS"].split(",") == ["memory", "ssd", "redis"]
        targets = {t for _, t, _ in s.volumes()}
        assert env["DEEPSERVE_KV_SSD_DIR"] in targets, f"{s.name}: SSD tier directory is not a volume"
        assert env["DEEPSERVE_KV_FS_DIR"] in targets, f"{s.name}: shared FS tier directory is not a volume"
        assert env["DEEPSERVE_KV_REDIS_URL"].startswith("redis://redis:6379/")

    # Prefill and decode share the FS-tier volume but each keeps its own SSD volume.
    def src(s: cm.Service, target: str) -> str:
        return next(v for v, t, _ in s.volumes() if t == target)

    p, d = svcs["prefill"], svcs["decode"]
    assert src(p, "/mnt/kv-shared") == src(d, "/mnt/kv-shared")
    assert src(p, "/var/cache/deepserve/kv") != src(d, "/var/cache/deepserve/kv")


def test_kv_environment_is_what_kvstore_reads(svcs: dict[str, cm.Service]) -> None:
    """The DEEPSERVE_KV_* values build a valid KVStoreConfig (once kvstore/config.py exists)."""
    config = pytest.importorskip("kvstore.config", reason="kvstore/config.py not written yet")
    env = svcs["prefill"].environment()
    cfg = config.KVStoreConfig.from_env(env)
    assert list(cfg.tiers) == env["DEEPSERVE_KV_TIERS"].split(",")
    assert cfg.redis_url == env["DEEPSERVE_KV_REDIS_URL"]
    assert cfg.ssd_dir == env["DEEPSERVE_KV_SSD_DIR"] and cfg.fs_dir == env["DEEPSERVE_KV_FS_DIR"]
    known = {f"DEEPSERVE_KV_{f.upper()}" for f in config.KVStoreConfig.__dataclass_fields__}
    assert {k for k in env if k.startswith("DEEPSERVE_KV_")} <= known


def test_published_ports(svcs: dict[str, cm.Service]) -> None:
    """Only the user-facing endpoints are published on the host: API, Grafana, Prometheus."""
    published = {n for n, s in svcs.items() if s.spec.get("ports")}
    assert published == {"gateway", "grafana", "prometheus"}
    assert svcs["gateway"].spec["ports"] == ["8000:8000"]
    assert svcs["grafana"].spec["ports"] == ["3000:3000"]


def test_images_are_pinned(svcs: dict[str, cm.Service]) -> None:
    for s in svcs.values():
        image = s.spec["image"]
        assert ":" in image and not image.endswith(":latest"), f"{s.name}: pin the image tag ({image})"
        if s.is_deepserve:
            assert s.spec["build"]["context"] == "."
            assert image == f"deepserve:{s.spec['build']['args']['VARIANT']}"


def test_internal_services_share_the_token_model_init_writes(svcs: dict[str, cm.Service]) -> None:
    """Gateway, router and workers read the internal token from the `internal-token` volume
    (read-only), which the one-shot `model-init` fills; none of them runs without it."""
    init = svcs["model-init"]
    assert "make-internal-token --out /run/deepserve/internal-token" in init.argv()[-1]
    assert ("internal-token", "/run/deepserve", False) in init.volumes()
    for s in svcs.values():
        args = s.deepserve_args() or []
        if not args or args[0] not in SERVING_SUBCOMMANDS:
            continue
        assert s.environment().get("DEEPSERVE_INTERNAL_TOKEN_FILE") == "/run/deepserve/internal-token", s.name
        assert ("internal-token", "/run/deepserve", True) in s.volumes(), s.name
        assert s.name == "gateway" or "--open-metrics" in args, f"{s.name}: Prometheus scrapes it without the token"
