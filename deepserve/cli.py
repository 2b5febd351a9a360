"""The ``deepserve`` command: one sub-command per component, each defined beside its component.

Every component module exposes ``add_parser(subparsers)`` that registers its sub-command with a
``func`` default taking the parsed args; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# The modules whose ``add_parser`` registers a sub-command (every one ships with the distribution).
SUBCOMMANDS: list[str] = [
    "engine.cli",  # make-tiny-model, generate, engine
    "engine.model.random_checkpoint",  # make-random-checkpoint
    "server.cli",  # up, gateway
    "router.cli",  # router
    "bench.cli",  # bench, simulate
    "deepserve.internal_auth",  # make-internal-token
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
