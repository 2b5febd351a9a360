"""State memory manager: fixed pools of 128-token block slots and per-sequence boundary slots.

A V4 sequence's state is block data (compressed + indexer rows, growing with length, one slot
per cache unit of ``unit_tokens``) plus a fixed-size boundary state (SWA windows, compressor
buffers and overlaps). Both pools are sized once from a byte budget; the tensors themselves live
with each sequence's ``SequenceState`` and the pool accounts for them, so admission and
preemption decisions are exact in bytes. A shortfall is a ``False`` return, never an exception.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import CSA, SLIDING, ModelConfig

MAX_CONTEXT = 1 << 20  # tokens; DeepSeek-V4's longest context


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one block unit, bytes of one boundary state) for this architecture."""
    if not isinstance(cfg, ModelConfig):  # another family (V4.1) accounts for its own state
        from engine.model.v41.state import state_bytes as v41_state_bytes

        return v41_state_bytes(cfg, dtype)
    e = torch.tensor([], dtype=dtype).element_size()
    unit = cfg.unit_tokens
    block = 0
    boundary = 0
    for layer_type in cfg.layer_types:
        boundary += (cfg.sliding_window - 1) * cfg.head_dim * e
        if layer_type == SLIDING:
            continue
        rate = cfg.compress_rate(layer_type)
        width = 2 * cfg.head_dim if layer_type == CSA else cfg.head_dim
        block += (unit // rate) * cfg.head_dim * e
        boundary += 2 * (rate - 1) * width * e  # buffered kv + gate
        if layer_type == CSA:
            block += (unit // rate) * cfg.index_head_dim * e
            boundary += 2 * (rate - 1) * 2 * cfg.index_head_dim * e
            boundary += rate * (cfg.head_dim + cfg.index_head_dim) * (e + 4)  # overlaps (gate fp32)
        boundary += (unit // rate) * cfg.head_dim * e  # rows past the last whole unit
    return block, boundary


class StatePool:
    """Slot accounting for one engine's sequences (see module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, budget_bytes: int, max_seqs: int) -> None:
        self.unit = cfg.unit_tokens
        self.block_bytes, self.boundary_bytes = state_bytes(cfg, dtype)
        self.num_boundary = max_seqs
        rest = budget_bytes - max_seqs * self.boundary_bytes
        if rest < self.block_bytes:
            raise ValueError(
                f"state memory budget {budget_bytes} B too small for {max_seqs} sequences "
                f"({self.boundary_bytes} B boundary each) plus one {self.block_bytes} B block"
            )
        # a model without compressing layers has no block data: cap the (then free) block pool at
        # what max_seqs sequences of MAX_CONTEXT tokens could ever use
        cap = max_seqs * math.ceil(MAX_CONTEXT / self.unit)
        self.num_blocks = max(1, min(cap, rest // max(self.block_bytes, 1)))
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._free_boundary = max_seqs
        self._owners: dict[int, object] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.unit)

    def bytes_for(self, num_tokens: int) -> int:
        """State bytes one sequence of ``num_tokens`` tokens is accounted: its blocks and a boundary."""
        return self.blocks_needed(num_tokens) * self.block_bytes + self.boundary_bytes

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits the pools at all (alone)."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    @property
    def max_tokens(self) -> int:
        """The longest sequence the block pool can hold."""
        return self.num_blocks * self.unit

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pools account in all (blocks and boundaries)."""
        return self.num_blocks * self.block_bytes + self.num_boundary * self.boundary_bytes

    def allocate(self, owner: object, block_ids: list[int], has_boundary: bool, num_tokens: int) -> bool:
        """Grow ``block_ids`` (in place) to cover ``num_tokens`` and take a boundary slot if needed.

        Returns False (changing nothing) when either pool is short.
        """
        extra = self.blocks_needed(num_tokens) - len(block_ids)
        if extra > len(self._free_blocks) or (not has_boundary and self._free_boundary == 0):
            return False
        if not has_boundary:
            self._free_boundary -= 1
        for _ in range(max(extra, 0)):
            b = self._free_blocks.pop()
            self._owners[b] = owner
            block_ids.append(b)
        return True

    def free(self, block_ids: list[int], has_boundary: bool) -> None:
        for b in block_ids:
            del self._owners[b]
            self._free_blocks.append(b)
        block_ids.clear()
        if has_boundary:
            self._free_boundary += 1

    @property
    def usage(self) -> float:
        """Fraction of the byte budget in use (blocks and boundaries)."""
        used = (self.num_blocks - len(self._free_blocks)) * self.block_bytes
        used += (self.num_boundary - self._free_boundary) * self.boundary_bytes
        return used / self.capacity_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def check_integrity(self, live: dict[object, tuple[list[int], bool]]) -> None:
        """Assert the pools agree with the live sequences ``{owner: (block_ids, has_boundary)}``."""
        owned = [b for ids, _ in live.values() for b in ids]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert set(owned) == set(self._owners), "block ownership table disagrees with sequences"
        assert not set(owned) & set(self._free_blocks), "a live block is on the free list"
        assert len(owned) + len(self._free_blocks) == self.num_blocks, "blocks leaked"
        for owner, (ids, _) in live.items():
            assert all(self._owners[b] is owner for b in ids), "block owned by another sequence"
        boundaries = sum(1 for _, has in live.values() if has)
        assert boundaries + self._free_boundary == self.num_boundary, "boundary slots leaked"
