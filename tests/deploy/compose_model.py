"""docker-compose.yml as data: interpolation, active services, commands, ports, dependencies.

Just enough of the Compose specification to check the file and to run its topology without
Docker (``test_compose_processes.py``); no Docker or Compose binary is involved.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.contract import ROOT

COMPOSE_FILE = ROOT / "docker-compose.yml"
# The image's ENTRYPOINT (Dockerfile): what a deepserve service's `command` is appended to.
IMAGE_ENTRYPOINT = ["deepserve"]

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}, $VAR, and $$ (a literal $).
_VAR = re.compile(
    r"\$(?:(?P<esc>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution applied to every string in ``value`` (recursively)."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def _substitute(m: re.Match[str], env: Mapping[str, str]) -> str:
    if m.group("esc"):
        return "$"
    name = m.group("braced") or m.group("plain")
    op, arg = m.group("op"), m.group("arg") or ""
    val = env.get(name)
    if op in (":-", ":?"):
        missing = not val
    else:
        missing = val is None
    if op and op.endswith("-") and missing:
        return arg
    if op and op.endswith("?") and missing:
        raise ValueError(f"required variable {name} is not set: {arg}")
    return val or ""


def load_raw(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The file as YAML data (anchors and ``<<`` merges resolved, variables not substituted)."""
    with open(path) as f:
        return yaml.safe_load(f)


def load(env: Mapping[str, str] | None = None, path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The file with variables substituted from ``env`` (default: none set, so every default)."""
    return interpolate(load_raw(path), dict(env or {}))


@dataclass(frozen=True)
class Service:
    """One service of an interpolated compose file, with the questions the tests ask of it."""

    name: str
    spec: dict[str, Any]

    @property
    def profiles(self) -> list[str]:
        return list(self.spec.get("profiles") or [])

    @property
    def replicas(self) -> int:
        return int((self.spec.get("deploy") or {}).get("replicas", 1))

    @property
    def is_deepserve(self) -> bool:
        """Runs the deepserve image (built from the Dockerfile here)."""
        return "build" in self.spec

    def argv(self) -> list[str]:
        """The full argv the container runs: entrypoint + command."""
        entry = self.spec.get("entrypoint")
        cmd = self.spec.get("command") or []
        entry = shlex.split(entry) if isinstance(entry, str) else list(entry or [])
        cmd = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        if not entry and self.is_deepserve:
            entry = list(IMAGE_ENTRYPOINT)
        return entry + cmd

    def deepserve_args(self) -> list[str] | None:
        """The arguments after ``deepserve`` (also inside ``sh -c '...'``), or None."""
        argv = self.argv()
        if len(argv) >= 3 and argv[0] in ("/bin/sh", "sh") and argv[1] == "-c":
            argv = shlex.split(argv[2])
        for i, tok in enumerate(argv):
            if tok == "deepserve":
                rest = argv[i + 1 :]
                # stop at a shell operator following the command
                for j, t in enumerate(rest):
                    if t in ("&&", "||", ";", "|"):
                        rest = rest[:j]
                        break
                return rest
        return None

    def flag(self, name: str) -> str | None:
        args = self.deepserve_args() or self.argv()
        if name in args:
            idx = args.index(name)
            return args[idx + 1] if idx + 1 < len(args) else None
        return None

    def flag_values(self, name: str) -> list[str]:
        """All values after ``name`` up to the next ``--flag`` (``--decode a b`` -> [a, b])."""
        args = self.deepserve_args() or []
        out: list[str] = []
        for i, tok in enumerate(args):
            if tok == name:
                for v in args[i + 1 :]:
                    if v.startswith("--"):
                        break
                    out.append(v)
        return out

    def container_ports(self) -> list[int]:
        ports = [int(p) for p in self.spec.get("expose") or []]
        for p in self.spec.get("ports") or []:
            target = p["target"] if isinstance(p, dict) else str(p).split(":")[-1].split("/")[0]
            ports.append(int(target))
        return sorted(set(ports))

    def aliases(self) -> list[str]:
        nets = self.spec.get("networks") or {}
        out: list[str] = []
        if isinstance(nets, dict):
            for net in nets.values():
                out += list((net or {}).get("aliases") or [])
        return out

    def depends_on(self) -> dict[str, dict[str, Any]]:
        deps = self.spec.get("depends_on") or {}
        if isinstance(deps, list):
            return {d: {"condition": "service_started", "required": True} for d in deps}
        return {
            k: {"condition": v.get("condition", "service_started"), "required": v.get("required", True)} for k, v in deps.items()
        }

    def healthcheck_argv(self) -> list[str] | None:
        test = (self.spec.get("healthcheck") or {}).get("test")
        if not test or self.spec["healthcheck"].get("disable"):
            return None
        if isinstance(test, str):
            return ["/bin/sh", "-c", test]
        if test[0] == "CMD":
            return list(test[1:])
        if test[0] == "CMD-SHELL":
            return ["/bin/sh", "-c", test[1]]
        return None

    def environment(self) -> dict[str, str]:
        env = self.spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
        return {k: "" if v is None else str(v) for k, v in env.items()}

    def volumes(self) -> list[tuple[str, str, bool]]:
        """(source, target, read_only) of each short- or long-syntax mount."""
        out = []
        for v in self.spec.get("volumes") or []:
            if isinstance(v, dict):
                out.append((v.get("source", ""), v["target"], bool(v.get("read_only"))))
                continue
            parts = v.split(":")
            src, tgt = parts[0], parts[1]
            mode = parts[2] if len(parts) > 2 else "rw"
            out.append((src, tgt, "ro" in mode.split(",")))
        return out


def services(compose: dict[str, Any]) -> dict[str, Service]:
    return {name: Service(name, spec) for name, spec in compose["services"].items()}


def active(compose: dict[str, Any], profiles: tuple[str, ...] = ()) -> dict[str, Service]:
    """Services that ``docker compose [--profile P] up`` starts: enabled by profile, replicas > 0."""
    return {n: s for n, s in services(compose).items() if (not s.profiles or set(s.profiles) & set(profiles)) and s.replicas > 0}


def start_order(svcs: Mapping[str, Service]) -> list[str]:
    """Topological order of ``svcs`` by depends_on (dependencies that are not in ``svcs`` ignored)."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, path: tuple[str, ...]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ValueError(f"depends_on cycle: {' -> '.join(path + (n,))}")
        state[n] = 1
        for dep in svcs[n].depends_on():
            if dep in svcs:
                visit(dep, path + (n,))
        state[n] = 2
        order.append(n)

    for n in sorted(svcs):
        visit(n, ())
    return order


def hostnames(svcs: Mapping[str, Service]) -> dict[str, str]:
    """Name or network alias -> the service answering to it."""
    out = {}
    for s in svcs.values():
        out[s.name] = s.name
        for a in s.aliases():
            out.setdefault(a, s.name)
    return out


URL_RE = re.compile(r"\b(?P<scheme>https?|redis|rediss)://(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)")
