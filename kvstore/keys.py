"""Content-addressed keys for KV cache units.

A unit covers a ``block_size``-aligned run of tokens. Its key is a chained hash: the hash of the
parent unit's key, the model fingerprint, the record format and the unit's token ids, so two
prompts share a key exactly when they share the whole prefix up to that unit's end. The router
hashes prompts with this same function, so its index speaks the engine's units.

This module is the one definition of the key: the engine's KV connector, the DeepInfer bridge,
the router and the cluster simulator all call it. The ids enter the hash by value, in one canonical
encoding (``token_text``: each id in decimal without leading zeros, joined by commas,
nothing else), so any sequence type holding the same values (list, tuple, numpy, torch) gives the
same keys; docs/ARCHITECTURE.md writes the whole key down. The encoding is part of the stored
format (``FORMAT``): changing it orphans every stored record.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import orjson

ROOT_KEY = "0" * 32  # the parent of a prompt's first unit
FORMAT = "v2"  # the unit key's definition: v2 hashes the ids' decimal text (v1: their int64 bytes)


def token_text(token_ids: Sequence[int]) -> bytes:
    """The ids' canonical encoding, what unit keys hash: decimal, comma-separated, nothing else
    (``1,20,300``); written by orjson (0.6 µs for 128 ids), whose array text is exactly that."""
    try:
        return orjson.dumps(token_ids if type(token_ids) is list else list(token_ids))[1:-1]
    except TypeError:  # numpy or torch integers, beyond-64-bit ints: one at a time
        return b",".join(b"%d" % int(t) for t in token_ids)


@functools.lru_cache(maxsize=64)
def _salt(fingerprint: str, fmt: str) -> bytes:
    """The key prefix of a model and key format: built once (a router hashes every prompt with
    the same one)."""
    return b"%s%s:" % (fingerprint.encode(), fmt.encode())


def _chain(texts: Sequence[bytes], salt: bytes, parent: str = ROOT_KEY) -> list[str]:
    """The chained keys of units given as texts (one SHA-256 each, the salt encoded once)."""
    keys: list[str] = []
    sha = hashlib.sha256
    for text in texts:
        parent = sha(b"%s%s%s" % (parent.encode(), salt, text)).hexdigest()[:32]
        keys.append(parent)
    return keys


def unit_key(parent: str, token_ids: Sequence[int], fingerprint: str, fmt: str = FORMAT) -> str:
    """Key (32 hex chars) of the unit holding ``token_ids`` after the prefix keyed by ``parent``:
    the first 128 bits of a SHA-256 of the parent key, the model fingerprint, the format, a colon
    and the ids' canonical text (``token_text``)."""
    return _chain((token_text(token_ids),), _salt(fingerprint, fmt), parent)[0]


def chain_keys(token_ids: Sequence[int], block_size: int, fingerprint: str, fmt: str = FORMAT) -> list[str]:
    """Keys of every whole ``block_size`` unit of ``token_ids``, in order (partial tail excluded)."""
    units = [token_text(token_ids[s : s + block_size]) for s in range(0, len(token_ids) - block_size + 1, block_size)]
    return _chain(units, _salt(fingerprint, fmt))
