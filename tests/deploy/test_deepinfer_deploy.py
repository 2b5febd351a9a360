"""The DeepInfer deployment files: deploy/docker/Dockerfile.deepinfer, the per-rank launcher
deploy/docker/deepinfer-ranks.sh, deploy/compose.deepinfer.yml and the Kustomize overlay
deploy/k8s/overlays/deepinfer. Nothing here can build or run them on SM100: these are the static
checks (the launcher runs against a recording stand-in of the `deepserve` command)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from tests.deploy import compose_model as cm
from tests.deploy.contract import ROOT

DOCKERFILE = ROOT / "deploy/docker/Dockerfile.deepinfer"
LAUNCHER = ROOT / "deploy/docker/deepinfer-ranks.sh"
COMPOSE = ROOT / "deploy/compose.deepinfer.yml"
OVERLAY = ROOT / "deploy/k8s/overlays/deepinfer"


def engine_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``deepserve engine ...`` with the real CLI (a renamed flag fails here)."""
    from engine.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert argv[0] == "engine"
    return parser.parse_args(argv)


def test_the_image_builds_deepinfer_then_deepserve() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"nvidia/cuda:13\.\S+-devel-ubuntu24\.04", text)  # CUDA 13, GCC 13
    assert "python3.12 -m venv" in text and "DEEPINFER_ACCELERATOR=nvidia" in text
    assert text.index("./build.sh") < text.index("pip install .")  # DeepInfer's pins first
    assert all(f"COPY {p} ./{p}" in text for p in ("deepserve", "engine", "kvstore", "router", "server", "kernels", "bench"))
    assert "USER deepserve" in text and 'ENTRYPOINT ["deepinfer-ranks.sh"]' in text
    assert "deepserve-healthcheck" in text


@pytest.fixture()
def fake_deepserve(tmp_path: Path) -> Path:
    """A `deepserve` on PATH that records its argv and GPU, then exits with $FAKE_EXIT_<rank>."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "deepserve"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'rank=""; prev=""; for a in "$@"; do [ "$prev" = --dp-rank ] && rank=$a; prev=$a; done\n'
        f'printf "%s\\n" "$CUDA_VISIBLE_DEVICES $MASTER_PORT $*" > "{tmp_path}/rank$rank"\n'
        'code_var="FAKE_EXIT_$rank"; code=${!code_var:-}\n'
        'if [ -n "$code" ]; then sleep 1; exit "$code"; fi\n'
        "exec sleep 30\n"
    )
    script.chmod(0o755)
    return bin_dir


def test_the_launcher_starts_one_worker_per_rank_and_stops_the_group_when_one_dies(fake_deepserve: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{fake_deepserve}:{os.environ['PATH']}", "DEVICE_OFFSET": "4", "MASTER_PORT": "29600", "FAKE_EXIT_2": "3"}
    proc = subprocess.run(["bash", str(LAUNCHER), "decode", "8400", "3", "--model", "/models", "--ep", "3"], env=env, timeout=20)
    assert proc.returncode == 3  # rank 2 died: the launcher stopped ranks 0 and 1 and exited with its status
    for rank in range(3):
        gpu, master, *argv = (tmp_path / f"rank{rank}").read_text().split()
        assert (gpu, master) == (str(4 + rank), "29600")
        args = engine_args(argv)
        assert (args.backend, args.role, args.dp, args.dp_rank, args.port, args.ep) == ("deepinfer", "decode", 3, rank, 8400 + rank, 3)
        assert args.host == "0.0.0.0" and args.worker_id.endswith(f"-r{rank}")


def test_compose_override_is_valid_and_the_router_lists_every_rank() -> None:
    raw = cm.load_raw(COMPOSE)
    schema = json.loads((ROOT / "tests/deploy/compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(raw)
    svcs = cm.interpolate(raw, {})["services"]
    urls: dict[str, list[str]] = {}
    for name, role in (("prefill-deepinfer", "prefill"), ("decode-deepinfer", "decode")):
        role_arg, base, dp, *rest = svcs[name]["command"]
        assert role_arg == role and svcs[name]["profiles"] == ["deepinfer"]
        args = engine_args(["engine", "--backend", "deepinfer", "--role", role, "--dp", dp, "--dp-rank", "0", *rest])
        assert args.ep == int(dp)
        urls[role] = [f"http://{name}:{int(base) + r}" for r in range(int(dp))]
        assert svcs[name]["expose"] == [str(int(base) + r) for r in range(int(dp))]
    router = svcs["router"]["command"]
    assert router[router.index("--prefill") + 1 : router.index("--decode")] == urls["prefill"]
    assert router[router.index("--decode") + 1 : router.index("--open-metrics")] == urls["decode"]
    assert svcs["prefill-deepinfer"]["environment"]["DEEPINFER_PREFILL_STORE_EXTRA_STATE"] == "1"
    assert svcs["decode-deepinfer"]["environment"]["DEEPINFER_PREFILL_STORE_EXTRA_STATE"] == "0"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_overlay_renders_with_one_router_url_per_rank() -> None:
    import yaml

    objs = list(yaml.safe_load_all(subprocess.run(["kubectl", "kustomize", str(OVERLAY)], check=True, capture_output=True, text=True, timeout=60).stdout))
    sets = {o["metadata"]["name"]: o for o in objs if o and o["kind"] == "StatefulSet"}
    router = next(o for o in objs if o and o["kind"] == "Deployment" and o["metadata"]["name"] == "router")
    router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode"):
        engine = sets[role]["spec"]["template"]["spec"]["containers"][0]
        assert engine["image"].split(":")[0].endswith("deepserve-deepinfer") and engine["command"] == ["deepinfer-ranks.sh"]
        role_arg, base, dp, *rest = engine["args"]
        assert role_arg == role
        engine_args(["engine", "--backend", "deepinfer", "--role", role, "--dp", dp, "--dp-rank", "0", *rest])
        wanted = [f"http://{role}-{i}.{role}:{int(base) + r}" for i in range(sets[role]["spec"]["replicas"]) for r in range(int(dp))]
        flag = router_args.index(f"--{role}")
        assert router_args[flag + 1 : flag + 1 + len(wanted)] == wanted
    policy = next(o for o in objs if o and o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "deepserve-workers")
    ports = policy["spec"]["ingress"][0]["ports"][0]
    assert ports["port"] <= 8200 and ports["endPort"] >= 8208
