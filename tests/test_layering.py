"""The package layering (docs/ARCHITECTURE.md), checked over the import graph of the source tree.

Every ``import`` statement counts, those inside functions too (a lazy import is still a
dependency). The rules:
- ``deepserve.protocol`` is a leaf: it imports no other package of the project;
- ``kvstore``, ``router`` and ``server`` import nothing from ``engine`` or ``kernels`` (they share
  only the typed messages of ``deepserve.protocol``);
- ``kernels`` imports nothing from ``engine`` (the math both use is in ``kernels.reference``);
- ``engine`` imports nothing from ``server`` or ``router``; no product package imports ``tests``
  or ``bench``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("deepserve", "engine", "kvstore", "router", "server", "kernels", "bench", "tests")
PRODUCT = ("deepserve", "engine", "kvstore", "router", "server", "kernels")
FORBIDDEN: dict[str, set[str]] = {
    "deepserve.protocol": set(PROJECT) - {"deepserve.protocol"},
    "kvstore": {"engine", "kernels", "router", "server"},
    "router": {"engine", "kernels", "server"},
    "server": {"engine", "kernels"},
    "kernels": {"engine", "kvstore", "router", "server"},
    "engine": {"server", "router"},
}


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (``deepserve.protocol`` apart from the rest of
    ``deepserve``), or None outside the project."""
    if module == "deepserve.protocol" or module.startswith("deepserve.protocol."):
        return "deepserve.protocol"
    top = module.split(".", 1)[0]
    return top if top in PROJECT else None


def imported_modules(source: str, package: str) -> set[str]:
    """Every module named by an ``import`` or ``from … import`` in the source of a module of
    ``package`` (relative imports resolved)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # ``from deepserve import protocol``
    return names


def violations() -> list[str]:
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            layer = layer_of(module)
            banned = FORBIDDEN.get(layer or "", set()) | {"tests", "bench"}
            for name in sorted(imported_modules(path.read_text(encoding="utf-8"), module.rsplit(".", 1)[0])):
                target = layer_of(name)
                if target is not None and target != layer and target in banned:
                    found.append(f"{path.relative_to(ROOT)} imports {name} ({layer} → {target})")
    return found


def test_layers_import_only_downwards() -> None:
    assert violations() == []


@pytest.mark.parametrize(
    "module,layer",
    [("deepserve.protocol.messages", "deepserve.protocol"), ("deepserve.cli", "deepserve"), ("engine.model", "engine"), ("numpy", None)],
)
def test_layer_of(module: str, layer: str | None) -> None:
    assert layer_of(module) == layer


def test_relative_and_from_package_imports_are_seen() -> None:
    source = "from .. import events\nfrom deepserve import protocol\ndef f():\n    import engine.model\n"
    names = imported_modules(source, "kvstore.backends")
    assert {"kvstore.events", "deepserve.protocol", "engine.model"} <= names
