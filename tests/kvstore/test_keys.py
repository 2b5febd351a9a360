"""Unit keys (``kvstore.keys``): the one definition, as docs/ARCHITECTURE.md writes it down."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import orjson
import pytest
import torch

from kvstore.keys import FORMAT, ROOT_KEY, chain_keys, token_text, unit_key


def test_token_text_is_the_canonical_decimal_encoding():
    ids = [0, 1, 20, 129279, 2**40]
    assert token_text(ids) == b"0,1,20,129279,1099511627776" == orjson.dumps(ids)[1:-1]
    assert token_text(tuple(ids)) == token_text(np.array(ids)) == token_text(torch.tensor(ids)) == token_text(ids)
    assert token_text([2**70, 3]) == b"1180591620717411303424,3"  # beyond 64 bits: still exact
    assert token_text([]) == b""


def _written_down(ids: list[int], block: int, fingerprint: str) -> list[str]:
    """The key as docs/ARCHITECTURE.md ("KV unit keys") defines it, computed by hand."""
    keys, parent = [], "0" * 32
    for s in range(0, len(ids) - block + 1, block):
        text = ",".join(str(t) for t in ids[s : s + block])
        parent = hashlib.sha256(f"{parent}{fingerprint}{FORMAT}:{text}".encode()).hexdigest()[:32]
        keys.append(parent)
    return keys


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 256, 640, 1000])
def test_keys_are_the_written_down_definition(n):
    rng = random.Random(n)
    ids = [rng.randrange(200_000) for _ in range(n)]
    keys = chain_keys(ids, 128, "fp")
    assert keys == _written_down(ids, 128, "fp") == chain_keys(np.array(ids, dtype=np.int64), 128, "fp")
    assert len(keys) == n // 128
    if keys:
        assert keys[0] == unit_key(ROOT_KEY, ids[:128], "fp")


def test_the_key_format_is_pinned():
    """Stored records are found by these keys: a change of the definition must be deliberate
    (a new ``FORMAT``), never a side effect of a faster implementation."""
    assert FORMAT == "v2"
    assert chain_keys(list(range(256)), 128, "fp") == ["0749ad265afc651d42ba222ca6550a30", "4b117e9ba54aee7226052345731d3b91"]


def test_keys_chain_and_depend_on_fingerprint():
    a = [3] * 256
    b = [4] * 128 + [3] * 128
    ka, kb = chain_keys(a, 128, "fp"), chain_keys(b, 128, "fp")
    assert ka[0] != kb[0] and ka[1] != kb[1]  # same second unit, different prefix
    assert chain_keys(a, 128, "other") != ka
    assert chain_keys(a[:200], 128, "fp") == ka[:1]
