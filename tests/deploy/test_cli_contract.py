"""Every `deepserve ...` command line in the deployment files parses with the real CLI.

Compose commands (both modes), every container and init container of every Kustomize rendering,
and the Dockerfile's default CMD are fed to ``deepserve.cli.build_parser().parse_args`` (parsing
only, nothing runs). A sub-command whose component is not written yet is skipped, not failed;
once it lands, a renamed flag or a changed choice fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from typing import Any

import pytest

from tests.deploy import compose_model as cm
from tests.deploy.contract import ROOT
from tests.deploy.k8s_render import KUBECTL


def _compose_commands() -> list[tuple[str, list[str]]]:
    out = []
    for label, env in (("compose", {}), ("compose-gpu", {"CPU_WORKERS": "0"})):
        for s in cm.services(cm.load(env)).values():
            args = s.deepserve_args()
            if args is not None:
                out.append((f"{label}:{s.name}", args))
    return out


def _k8s_commands(rendered: dict[str, list[dict[str, Any]]]) -> list[tuple[str, list[str]]]:
    out = []
    for name, objs in rendered.items():
        for o in objs:
            if o["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = o["spec"]["template"]["spec"]
            for c in pod["containers"] + (pod.get("initContainers") or []):
                if "deepserve" not in c["image"]:
                    continue
                argv = list(c.get("command") or []) + list(c.get("args") or [])
                if argv[:2] == ["/bin/sh", "-c"]:
                    toks = shlex.split(argv[2])
                    argv = toks[toks.index("deepserve") + 1 :]
                out.append((f"k8s-{name}:{o['metadata']['name']}/{c['name']}", argv))
    return out


def _dockerfile_cmd() -> list[str]:
    m = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert m
    return json.loads(m.group(1))


def _parser() -> tuple[argparse.ArgumentParser, set[str]]:
    cli = pytest.importorskip("deepserve.cli")
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, set(subs.choices)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"`deepserve {shlex.join(argv)}` does not parse:\n{err.getvalue()}")
    raise AssertionError("unreachable")


def test_every_command_line_parses(request: pytest.FixtureRequest) -> None:
    parser, registered = _parser()
    rendered = request.getfixturevalue("rendered") if KUBECTL else {}  # without kubectl: compose + Dockerfile only
    commands = _compose_commands() + _k8s_commands(rendered) + [("Dockerfile:CMD", _dockerfile_cmd())]
    checked, pending = [], set()
    for where, argv in commands:
        if argv[0] not in registered:
            pending.add(argv[0])
            continue
        ns = _parse(parser, argv)
        checked.append(where)
        # Multi-URL flags must keep every URL (nargs="+" with extend, or append).
        for flag in ("--prefill", "--decode", "--worker"):
            given = _values(argv, flag)
            if given:
                value = getattr(ns, flag[2:])
                flat = [u for item in value for u in (item if isinstance(item, list) else [item])]
                assert flat == given, f"{where}: {flag} parsed as {value}, given {given}"
    if not checked:
        pytest.skip(f"no sub-command used by the deployment files is registered yet: {sorted(pending)}")
    if pending:
        print(f"not yet registered, not checked: {sorted(pending)}")


def _values(argv: list[str], flag: str) -> list[str]:
    """Values after every ``flag`` up to the next ``--option`` (``--decode a b`` -> [a, b])."""
    out: list[str] = []
    current = None
    for tok in argv:
        if tok.startswith("--"):
            current = tok
        elif current == flag:
            out.append(tok)
    return out
