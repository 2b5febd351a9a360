"""Rendering the Kustomize tree offline with `kubectl kustomize` (no cluster needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.contract import ROOT

K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
EXTERNAL = "external-redis"  # the gpu overlay plus the external-redis component


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH` (offline rendering) as a list of objects."""
    assert KUBECTL, "kubectl is not installed"
    r = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]
