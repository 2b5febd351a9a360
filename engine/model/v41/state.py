"""Per-sequence cached state of DeepSeek-V4.1 (D = head_dim, Di = index_head_dim, r = ratio, W =
sliding window, T = compressed rows so far).

- every layer: ``window`` (≤ W-1, D), the last W-1 FP8-rounded window keys (= values);
- every KV-source layer (``sources[layer]``):
  ``rows`` (T, D) the shared compressed KV, rotated and FP4-rounded (T = tokens // r, or more
  while a replay recomputes tokens whose rows were restored from the KV store);
  ``keys`` (T, Di) the shared indexer keys, rotated and FP4-rounded (None without an indexer);
  ``buf_kv`` / ``buf_gate`` (< r, D) fp32 projections of the tokens of the unfinished group;
- ``engram`` the last ``engram_max_ngram_size - 1`` compressed token ids (engram checkpoints);
- ``decoder_from`` > 0 after a bounded replay (``engine.kv_units_v41``): the decoder layers (from
  ``first_decoder_layer`` on) compute only the tokens from this position, their windows starting
  empty there; the state is then approximate and never stored as a snapshot.

Rows and keys grow with the sequence (block data); the rest is a fixed-size boundary state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.v41.config import V41Config


def state_bytes(cfg: V41Config, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one block unit, bytes of one boundary state) of a sequence, as this package
    stores them (``dtype`` rows, fp32 group buffers)."""
    e = torch.tensor([], dtype=dtype).element_size()
    unit = cfg.unit_tokens
    block = 0
    boundary = cfg.num_hidden_layers * (cfg.sliding_window - 1) * cfg.head_dim * e
    for i in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[i]
        row = cfg.head_dim + (cfg.index_head_dim if i in cfg.index_source_layer_ids else 0)
        block += unit // r * row * e
        boundary += 2 * (r - 1) * cfg.head_dim * 4  # the unfinished group's kv + gate
        boundary += unit // r * row * e  # rows past the last whole unit
    return block, boundary


@dataclass
class SourceState:
    """The shared compressed KV a KV-source layer publishes to its group."""

    rows: torch.Tensor  # (T, D)
    keys: torch.Tensor | None  # (T, Di)
    buf_kv: torch.Tensor  # (< r, D) fp32
    buf_gate: torch.Tensor  # (< r, D) fp32

    def clone(self) -> SourceState:
        return self.to(None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.keys, self.buf_kv, self.buf_gate) if t is not None)

    def to(self, device: torch.device | str | None) -> SourceState:
        """A copy on ``device`` (``None``: where it is)."""
        return SourceState(
            self.rows.to(device, copy=True), None if self.keys is None else self.keys.to(device, copy=True),
            self.buf_kv.to(device, copy=True), self.buf_gate.to(device, copy=True),
        )  # fmt: skip


@dataclass
class V41SequenceState:
    """All layers' state of one sequence after ``num_tokens`` tokens."""

    windows: list[torch.Tensor]  # per layer (≤ W-1, D)
    sources: dict[int, SourceState]  # per KV-source layer index
    engram: list[int] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # every token the state has consumed
    decoder_from: int = 0  # bounded replay: the decoder layers' first computed position

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.windows) + sum(s.nbytes() for s in self.sources.values())

    def clone(self) -> V41SequenceState:
        return self.to(None)

    def to(self, device: torch.device | str | None) -> V41SequenceState:
        """A copy with every tensor on ``device`` (``None``: where it is; a state moved between
        the CPU and a GPU model)."""
        return V41SequenceState(
            [w.to(device, copy=True) for w in self.windows], {i: s.to(device) for i, s in self.sources.items()},
            list(self.engram), self.num_tokens, list(self.token_ids), self.decoder_from,
        )  # fmt: skip
