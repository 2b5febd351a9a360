"""Fixtures of the deployment tests: the Kustomize renderings, made once per session."""

from __future__ import annotations

import os
from typing import Any

import pytest
import yaml

from tests.deploy.k8s_render import EXTERNAL, K8S, KUBECTL, kustomize


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """base, overlays dev and gpu, and gpu + the external-redis component, rendered."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = {name: kustomize(K8S / rel) for name, rel in (("base", "base"), ("dev", "overlays/dev"), ("gpu", "overlays/gpu"))}
    # An overlay as an operator would write it to use an external Redis (Kustomize wants relative paths).
    tmp = tmp_path_factory.mktemp("ovl")
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp)],
            "components": [os.path.relpath(K8S / "components" / "external-redis", tmp)],
        })
    )  # fmt: skip
    out[EXTERNAL] = kustomize(tmp)
    return out
