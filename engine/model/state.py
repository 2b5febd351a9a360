"""Per-sequence model state of DeepSeek-V4, split the way the KV store persists it.

Per layer (D = head_dim, Di = index_head_dim, r = compress rate, W = sliding window):

- ``swa``            (≤ W-1, D)   the last W-1 shared key/value rows (boundary state)
- ``comp.rows``      (T//r, D)    compressed rows of the CSA/HCA compressor (block data)
- ``comp.buf_kv/buf_gate`` (< r, 2D or D)  projected tokens of the unfinished window (boundary)
- ``comp.overlap_kv/overlap_gate`` (r, D)  CSA only: the previous window's first series (Ca)
  including the position bias on the gate (boundary)
- ``index``          the same for the CSA lightning indexer, at width Di

Block data for tokens ``[a, b)`` (``a, b`` multiples of the unit size) is ``rows[a//r : b//r]``
of every compressing layer; everything else is the boundary snapshot at ``num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """Running state of one compressor (main CSA/HCA branch or the CSA indexer)."""

    rows: torch.Tensor  # (T_c, D) emitted compressed rows, rope applied
    buf_kv: torch.Tensor  # (n < r, width) projected kv of tokens not yet in a closed window
    buf_gate: torch.Tensor  # (n < r, width) projected gates (position bias not yet added)
    overlap_kv: torch.Tensor | None = None  # (r, D) CSA: Ca series of the last closed window
    overlap_gate: torch.Tensor | None = None  # (r, D) its gates, position bias included
    # Windows consumed so far when fewer than ``len(rows)``: a replay over cached rows (resume
    # from KV blocks without a snapshot) recomputes windows whose rows are already present;
    # those are not appended again. ``None`` = ``len(rows)`` (the normal case).
    windows: int | None = None
    # While a speculative verify runs: the ``(kv, gate)`` projections of each ``update`` call, so a
    # rewind can replay the accepted tokens' share (``engine/model/rewind.py``); None otherwise.
    journal: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def nbytes(self) -> int:
        tensors = [self.rows, self.buf_kv, self.buf_gate, self.overlap_kv, self.overlap_gate]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def clone(self) -> CompressorState:
        return CompressorState(
            self.rows.clone(),
            self.buf_kv.clone(),
            self.buf_gate.clone(),
            None if self.overlap_kv is None else self.overlap_kv.clone(),
            None if self.overlap_gate is None else self.overlap_gate.clone(),
            self.windows,
        )


@dataclass
class LayerState:
    """State of one decoder layer for one sequence."""

    swa: torch.Tensor  # (≤ W-1, D)
    comp: CompressorState | None = None
    index: CompressorState | None = None

    def nbytes(self) -> int:
        n = self.swa.numel() * self.swa.element_size()
        return n + sum(c.nbytes() for c in (self.comp, self.index) if c is not None)

    def clone(self) -> LayerState:
        return LayerState(
            self.swa.clone(),
            None if self.comp is None else self.comp.clone(),
            None if self.index is None else self.index.clone(),
        )


@dataclass
class SequenceState:
    """All layers' state of one sequence after ``num_tokens`` tokens."""

    layers: list[LayerState]
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # every token the state has consumed

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def clone(self) -> SequenceState:
        return SequenceState([layer.clone() for layer in self.layers], self.num_tokens, list(self.token_ids))
