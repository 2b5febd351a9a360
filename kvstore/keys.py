"""Content-addressed keys for KV cache units.

A unit covers a ``block_size``-aligned run of tokens. Its key is a chained hash: the hash of the
parent unit's key, the model fingerprint, the record format and the unit's token ids, so two
prompts share a key exactly when they share the whole prefix up to that unit's end. The router
hashes prompts with this same function, so its index speaks the engine's units.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_KEY = "0" * 32


def unit_key(parent: str, token_ids: Sequence[int], fingerprint: str, fmt: str = "v1") -> str:
    """Key (32 hex chars) of the unit holding ``token_ids`` after the prefix keyed by ``parent``:
    the first 128 bits of a SHA-256. (BLAKE2b-128 until issue 6's router work: with the CPU's SHA
    instructions SHA-256 takes 0.9 µs for a 128-token unit in CPython against 1.4 µs, and the
    router hashes every prompt it places.)"""
    h = hashlib.sha256()
    h.update(parent.encode())
    h.update(fingerprint.encode())
    h.update(fmt.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


def chain_keys(token_ids: Sequence[int], block_size: int, fingerprint: str, fmt: str = "v1") -> list[str]:
    """Keys of every whole ``block_size`` unit of ``token_ids``, in order (partial tail excluded)."""
    keys: list[str] = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = unit_key(parent, token_ids[start : start + block_size], fingerprint, fmt)
        keys.append(parent)
    return keys
