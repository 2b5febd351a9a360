"""Unit keys (``kvstore.keys``): the id-list and text forms give the same keys."""

from __future__ import annotations

import random

import numpy as np
import orjson
import pytest
import torch

from kvstore.keys import ROOT_KEY, TokenIdsText, chain_keys, chain_keys_text, token_text, unit_key, unit_texts


def test_token_text_is_the_json_array_text():
    ids = [0, 1, 20, 129279, 2**40]
    assert token_text(ids) == b"0,1,20,129279,1099511627776" == orjson.dumps(ids)[1:-1]
    assert token_text(tuple(ids)) == token_text(np.array(ids)) == token_text(torch.tensor(ids)) == token_text(ids)
    assert token_text([2**70, 3]) == b"1180591620717411303424,3"  # beyond 64 bits: still exact
    assert token_text([]) == b""


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 255, 256, 257, 640, 1000])
def test_text_keys_equal_id_keys(n):
    rng = random.Random(n)
    ids = [rng.randrange(200_000) for _ in range(n)]
    text = token_text(ids)
    units = unit_texts(text, n, 128)
    assert units == [token_text(ids[i : i + 128]) for i in range(0, n - 127, 128)]
    keys = chain_keys(ids, 128, "fp")
    assert len(keys) == n // 128
    assert chain_keys_text(text, n, 128, "fp") == keys == chain_keys(TokenIdsText(text, n), 128, "fp")
    if keys:
        assert keys[0] == unit_key(ROOT_KEY, ids[:128], "fp")


def test_keys_chain_and_depend_on_fingerprint():
    a = [3] * 256
    b = [4] * 128 + [3] * 128
    ka, kb = chain_keys(a, 128, "fp"), chain_keys(b, 128, "fp")
    assert ka[0] != kb[0] and ka[1] != kb[1]  # same second unit, different prefix
    assert chain_keys(a, 128, "other") != ka
    assert chain_keys(a[:200], 128, "fp") == ka[:1]


def test_token_ids_text_parses_once_on_access():
    t = TokenIdsText(b"5,6,7", 3)
    assert len(t) == 3 and t._ids is None  # counting does not parse
    assert t[1] == 6 and list(t) == [5, 6, 7] and t[-2:] == [6, 7]
    assert t == [5, 6, 7] and t != [5, 6]
    assert list(TokenIdsText(b"0", 1)) == [0]
