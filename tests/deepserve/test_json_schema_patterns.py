"""Fuzz: every ``pattern`` the audit accepts is compiled by xgrammar exactly as Python's ``re``
reads it (random patterns, random strings; xgrammar's schema path is the one under test)."""

from __future__ import annotations

import json
import random
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from deepserve.protocol.json_schema import SchemaError, enforceable_schema

ATOMS = ["a", "b", "S", "1", "-", "[a-z]", "[A-Z]", "[0-9]", "[A-Za-z]", "\\d", ".", "[abc]", "[^a]", "\\."]
ALPHABET = "abS1zZ9-."


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    k = rng.random()
    if depth > 2 or k < 0.4:
        s = rng.choice(ATOMS)
    elif k < 0.6:
        s = "(?:" + random_pattern(rng, depth + 1) + ")"
    elif k < 0.8:
        s = random_pattern(rng, depth + 1) + random_pattern(rng, depth + 1)
    else:
        s = "(?:" + random_pattern(rng, depth + 1) + "|" + random_pattern(rng, depth + 1) + ")"
    if s[-1] not in "*+?}":
        s += rng.choice(["", "", "", "*", "?", "+", "{1,3}"])
    return s


def check(n: int, seed: int) -> tuple[int, int]:
    """(patterns accepted and checked, patterns refused)."""
    rng = random.Random(seed)
    checked = refused = 0
    for _ in range(n):
        pattern = "^" + random_pattern(rng) + "$"
        try:
            spec = enforceable_schema({"type": "string", "pattern": pattern}, strict=False)
        except SchemaError:
            refused += 1
            continue
        grammar = xgr.Grammar.from_json_schema(spec)
        checked += 1
        for _ in range(60):
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
            if _is_grammar_accept_string(grammar, json.dumps(text)):
                assert re.search(pattern, text), f"xgrammar accepts {text!r} for {pattern!r}"
    return checked, refused


def test_accepted_patterns_match_as_python_reads_them() -> None:
    checked, refused = check(150, seed=0)
    assert checked >= 50 and refused >= 10, (checked, refused)


@pytest.mark.slow
def test_accepted_patterns_match_as_python_reads_them_long_run() -> None:
    checked, refused = check(3000, seed=1)
    assert checked >= 1000, (checked, refused)
