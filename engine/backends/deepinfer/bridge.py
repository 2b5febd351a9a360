"""What DeepInfer's hooks do with deepserve's pieces: store I/O of one engine's KV.

``KVBridge`` reads and writes DeepInfer cache bytes through ``CacheAccess`` (the engine's block
and state tensors and DeepInfer's state-slice helpers) and puts them through the ``kvstore``
tiers as the records of ``records.py``; the store publishes the ``stored`` KV events the router
polls, named with this engine's DP rank.

Positions: a snapshot at ``p`` (a multiple of 128) holds the windows ending at token ``p``; the
prompt's snapshot is at its last whole unit before the final token (``save_point``), read after
the prompt finished through the extra-state ring (``DEEPINFER_PREFILL_STORE_EXTRA_STATE=1`` keeps
``window + backtracking + 128`` tokens, so the window at ``p`` is still there). Decode snapshots
come from ``copy_state`` (the slot copied when a sequence stood on a unit boundary).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.backends.base import Handoff
from engine.backends.deepinfer.layout import KVSTORE_GRAIN, CacheLayout
from engine.backends.deepinfer.records import (
    block_header,
    block_tensors,
    handoff_key,
    handoff_record,
    snapshot_header,
    snapshot_tensors,
    snapshot_windows,
    write_block,
)
from engine.kv_connector import snapshot_key
from kvstore.keys import ROOT_KEY, chain_keys
from kvstore.record import Record
from kvstore.store import TieredStore


class DeepInferSeq(Protocol):
    """The part of DeepInfer's C++ ``Sequence`` wrapper the bridge reads (``_C/engine.pyi``)."""

    request_id: str

    @property
    def state_id(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...


class CacheAccess(Protocol):
    """One engine's cache tensors (``driver_worker.cache_engine``) and state-slice helpers."""

    def block_ids(self, seq: DeepInferSeq) -> list[int]:
        """The sequence's GPU blocks in token order (needs ``Sequence.block_table``: see DEEPINFER.md)."""

    def block(self, block_id: int) -> torch.Tensor:
        """GPU block ``block_id`` as ``(block_bytes,)`` uint8 (a view)."""

    def stored_windows(self, state_cache: torch.Tensor, state_id: int, position: int) -> torch.Tensor:
        """``select_state_slice_to_store(TO_CE=False)``: ``(state_size_to_disk,)`` windows at ``position``."""

    def decode_state(self, state_id: int, position: int) -> torch.Tensor:
        """``select_state_slice_to_store(TO_CE=True)``: ``(total_bytes_inference,)``."""

    def load_windows(self, state_id: int, position: int, windows: torch.Tensor) -> None:
        """``load_state_from_store_to_prefill_cache``: stored windows into a prefill state slot."""

    def load_decode_state(self, state_id: int, state: torch.Tensor) -> None:
        """A hand-off's full decode-side state into a decode engine's slot."""

    def states(self) -> torch.Tensor:
        """``gpu_states`` ``(slots, state_slot_bytes)`` uint8."""


@dataclass(frozen=True)
class PrefixHit:
    """A stored prefix: ``units`` blocks and the snapshot after them (``records``: blocks, snapshot)."""

    units: int
    records: list[Record]

    @property
    def num_tokens(self) -> int:
        return self.units * KVSTORE_GRAIN


def save_point(num_tokens: int) -> int:
    """The last whole unit strictly before the final token (an identical prompt resumes there)."""
    return (num_tokens - 1) // KVSTORE_GRAIN * KVSTORE_GRAIN


class KVBridge:
    """Saves and restores one DeepInfer engine's KV through a ``TieredStore``."""

    def __init__(
        self, store: TieredStore, layout: CacheLayout, fingerprint: str, dp_rank: int, *, read: bool = True, write: bool = True
    ) -> None:
        """The engine's ``CacheAccess`` is bound later (``attach``): DeepInfer allocates it while
        ``LLMEngine.__init__`` runs."""
        self.store = store
        self.cache: CacheAccess
        self.layout = layout
        self.fingerprint = fingerprint
        self.dp_rank = dp_rank
        self.read, self.write = read, write
        self._saved: dict[str, int] = {}  # request id -> units already in the store
        self.counts = {"units": 0, "snapshots": 0, "handoffs_sent": 0, "handoffs_taken": 0, "prefix_hits": 0}

    def keys(self, tokens: Seq[int]) -> list[str]:
        return chain_keys(tokens, KVSTORE_GRAIN, self.fingerprint)

    def forget(self, request_id: str) -> None:
        self._saved.pop(request_id, None)

    # ---- prefix hits ------------------------------------------------------------------------
    def lookup(self, prompt: Seq[int]) -> PrefixHit | None:
        """The longest stored prefix that ends in a snapshot before the last prompt token."""
        if not self.read:
            return None
        keys = self.keys(prompt[: len(prompt) - 1])
        present = self.store.longest_prefix(keys) if keys else 0
        units = next((j for j in range(present, 0, -1) if self.store.contains(snapshot_key(keys[j - 1]))), 0)
        if not units:
            return None
        records = self.store.get_many(keys[:units] + [snapshot_key(keys[units - 1])], dp_rank=self.dp_rank)
        if any(r is None for r in records):
            return None  # evicted in between: a miss, never a wrong state
        return PrefixHit(units, records)  # type: ignore[arg-type]

    def restore(self, seq: DeepInferSeq, hit: PrefixHit) -> None:
        """Write a hit's blocks and windows into ``seq``'s allocated blocks and state slot."""
        blocks = self.cache.block_ids(seq)
        for i, record in enumerate(hit.records[: hit.units]):
            write_block(self.layout, record, self.cache.block(blocks[i]))
        self.cache.load_windows(seq.state_id, hit.num_tokens, snapshot_windows(self.layout, hit.records[hit.units]))
        self._saved[seq.request_id] = hit.units
        self.counts["prefix_hits"] += 1

    # ---- saves ------------------------------------------------------------------------------
    def save(self, seq: DeepInferSeq, tokens: Seq[int], position: int, state_cache: torch.Tensor | None = None) -> int:
        """Store ``seq``'s blocks of the whole units before ``position`` not stored yet, and the
        snapshot at ``position`` (a multiple of 128) read from ``state_cache`` (default the live
        states). Returns the units stored."""
        if not self.write or position <= 0 or position % KVSTORE_GRAIN:
            return 0
        done = self._saved.get(seq.request_id, 0)
        units = position // KVSTORE_GRAIN
        if units <= done:
            return 0
        keys = self.keys(tokens[:position])
        blocks = self.cache.block_ids(seq)
        items = []
        for i in range(done, units):
            parent = keys[i - 1] if i else ROOT_KEY
            items.append((keys[i], block_header(self.layout, self.fingerprint, i, keys[i], parent), block_tensors(self.layout, self.cache.block(blocks[i]))))
        windows = self.cache.stored_windows(self.cache.states() if state_cache is None else state_cache, seq.state_id, position)
        skey = snapshot_key(keys[-1])
        items.append((skey, snapshot_header(self.layout, self.fingerprint, position, skey, keys[-1]), snapshot_tensors(self.layout, windows)))
        self.store.put_many(items, dp_rank=self.dp_rank)
        self._saved[seq.request_id] = units
        self.counts["units"] += units - done
        self.counts["snapshots"] += 1
        return units - done

    # ---- the PD hand-off --------------------------------------------------------------------
    def ship(self, seq: DeepInferSeq, prompt: Seq[int], first_token: int) -> Handoff:
        """Put ``seq``'s whole decode-side state, every prompt block and its first token under its
        hand-off key (a PROMPT engine's finished prompt)."""
        n = len(prompt)
        blocks = self.cache.block_ids(seq)[: -(-n // KVSTORE_GRAIN)]
        rows = torch.stack([self.cache.block(b).clone() for b in blocks])  # (n_blocks, block_bytes)
        key = handoff_key(self.fingerprint, seq.request_id)
        header, tensors = handoff_record(self.layout, self.fingerprint, key, n, first_token, self.cache.decode_state(seq.state_id, n).clone(), rows)
        self.store.put_many([(key, header, tensors)], dp_rank=self.dp_rank)
        self.counts["handoffs_sent"] += 1
        return Handoff(seq.request_id, "record", (key,), n, first_token)

    def fetch_handoff(self, request_id: str) -> Record | None:
        record = self.store.get_many([handoff_key(self.fingerprint, request_id)], dp_rank=self.dp_rank)[0]
        if record is None or not record.header.meta.get("handoff"):
            return None
        return record

    def inject(self, seq: DeepInferSeq, record: Record) -> None:
        """Write a hand-off record into ``seq``'s allocated blocks and state slot (a COMPLETION engine)."""
        ids = self.cache.block_ids(seq)
        rows = record.tensors["blocks"]  # (n_blocks, block_bytes)
        if rows.shape[0] > len(ids):
            raise ValueError(f"hand-off has {rows.shape[0]} blocks, the sequence got {len(ids)}")
        for i in range(rows.shape[0]):
            self.cache.block(ids[i]).copy_(rows[i])
        self.cache.load_decode_state(seq.state_id, record.tensors["state"])
        # the record stays until evicted: a decode stage retried on another decode worker reads it again
        self.counts["handoffs_taken"] += 1

    # ---- the cache ------------------------------------------------------------------------
    def attach(self, cache: CacheAccess) -> None:
        """Bind the engine's cache (known only once DeepInfer allocated it)."""
        self.cache = cache
