"""Dockerfile, .dockerignore and the health-check helper the image ships."""

from __future__ import annotations

import fnmatch
import http.server
import json
import re
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator

import pytest

from tests.deploy import compose_model as cm
from tests.deploy.contract import ROOT, SUBCOMMANDS

DOCKERFILE = ROOT / "Dockerfile"
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def test_multi_stage_with_variant_build_arg() -> None:
    stages = _stages()
    assert len(stages) >= 2
    names = [re.search(r"\bAS\s+(\S+)", s[0][1], re.IGNORECASE) for s in stages]
    assert [m.group(1) for m in names if m] == ["build", "runtime"]
    # VARIANT is a global ARG (usable in FROM) and re-declared in every stage that reads it.
    pre = DOCKERFILE.read_text().split("\nFROM ", 1)[0]
    assert re.search(r"^ARG VARIANT=cpu$", pre, re.MULTILINE)
    for stage in stages:
        body = " ".join(a for _, a in stage[1:])
        if "$VARIANT" in body or "${VARIANT}" in body:
            assert ("ARG", "VARIANT") in stage, "a stage reading VARIANT must declare it"
    build = " ".join(a for _, a in stages[0])
    assert "cpu)" in build and "cuda)" in build, "VARIANT must choose the torch wheel"
    assert "--index-url" in build


def test_runtime_stage_runs_deepserve_as_non_root_with_healthcheck() -> None:
    runtime = dict(_stages()[-1][::-1])  # last occurrence wins
    assert runtime["USER"] not in ("root", "0")
    assert json.loads(runtime["ENTRYPOINT"]) == ["deepserve"]
    cmd = json.loads(runtime["CMD"])
    assert cmd[0] in SUBCOMMANDS
    assert "deepserve-healthcheck" in runtime["HEALTHCHECK"]
    copies = [a for k, a in _stages()[-1] if k == "COPY"]
    assert any("deploy/docker/healthcheck.py /usr/local/bin/deepserve-healthcheck" in c for c in copies)
    assert any("--from=build /opt/venv /opt/venv" in c for c in copies)
    for port in (8000, 8100, 8200, 8201):
        assert str(port) in runtime["EXPOSE"].split()


def test_every_installed_package_is_copied_into_the_build() -> None:
    """pyproject's package list and the Dockerfile's COPY lines must not drift apart."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    wanted = {d for d in top if any(fnmatch.fnmatch(d, pat) for pat in patterns)}
    copied = {a.split()[0] for k, a in _stages()[0] if k == "COPY"}
    assert wanted <= copied, f"packages not copied into the image: {sorted(wanted - copied)}"
    assert "pyproject.toml" in copied


def _dockerignored(path: str, rules: list[str]) -> bool:
    ignored = False
    for rule in rules:
        neg = rule.startswith("!")
        pat = rule[1:] if neg else rule
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat.rstrip("/") + "/*") or path.startswith(pat.rstrip("/*") + "/"):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_sources_and_drops_local_state() -> None:
    rules = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    for stage in _stages():
        for kind, args in stage:
            words = [w for w in args.split() if not w.startswith("--")]
            if kind != "COPY" or "--from=" in args:
                continue
            for src in words[:-1]:
                assert not _dockerignored(src, rules), f"{src} is COPY'd but excluded by .dockerignore"
    for local in (".venv", ".git", "tests", "deploy/k8s", "bench/results"):
        assert _dockerignored(local, rules), f"{local} should stay out of the build context"


def test_compose_healthchecks_use_the_installed_helper() -> None:
    """docker-compose.yml calls `deepserve-healthcheck`: the name the Dockerfile installs."""
    for s in cm.services(cm.load()).values():
        if s.is_deepserve and s.healthcheck_argv():
            assert s.healthcheck_argv()[0] == "deepserve-healthcheck"


# --- the helper itself -------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.server.status if self.path == "/health" else 404)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _check(url: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), url, "2"], capture_output=True, timeout=20, check=False).returncode


def test_healthcheck_helper(health_server: http.server.HTTPServer) -> None:
    port = health_server.server_address[1]
    health_server.status = 200  # type: ignore[attr-defined]
    assert _check(f"http://127.0.0.1:{port}/health") == 0
    health_server.status = 503  # type: ignore[attr-defined]
    assert _check(f"http://127.0.0.1:{port}/health") == 1
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert _check(f"http://127.0.0.1:{closed}/health") == 1
