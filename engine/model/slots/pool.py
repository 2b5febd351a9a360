"""``SlotPool``: the V4 slot state of every layer in fixed tensors (the mechanism of a slot decoder:
load, export, free, nbytes; no step math).

Layout, ``S`` slots plus scratch slot ``S`` (padded batch rows of a bucket point there):
- window ring ``swa (S+1, W, D)``: token ``p`` at ``p % W``;
- per compressor (CSA/HCA main branch, CSA indexer), rate ``r``, width ``d``, projection ``P``:
  ``buf_kv/buf_gate (S+1, r, P)`` the raw projections of the open window (token ``p`` at
  ``p % r``); CSA: ``overlap_kv (S+1, r, d)`` and ``overlap_gate`` (the position bias's dtype)
  — the previous closed window's Ca series; ``rows (S+1, Tc+1, d)`` the compressed rows,
  ``Tc = max_tokens // r``, row ``Tc`` a scratch row.

Only normal-mode general-path states load (each compressor has consumed exactly its complete
windows); a replay state raises ``ValueError``, as does one with no room left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.attention import Attention, Compressor
from engine.model.fp8 import Weight
from engine.model.state import CompressorState, LayerState, SequenceState


@dataclass
class CompPool:
    """Fixed-capacity state of one compressor for all slots (module docstring)."""

    rows: torch.Tensor  # (S+1, Tc+1, d)
    buf_kv: torch.Tensor  # (S+1, r, P)
    buf_gate: torch.Tensor  # (S+1, r, P)
    overlap_kv: torch.Tensor | None  # (S+1, r, d) CSA
    overlap_gate: torch.Tensor | None  # (S+1, r, d) CSA, the position bias's dtype


@dataclass
class LayerPool:
    """One layer's slot state (module docstring), plus a step's per-layer weights."""

    swa: torch.Tensor  # (S+1, W, D)
    comp: CompPool | None
    index: CompPool | None
    # the fused step's projections of the attention input x (``merge_proj``), rows
    # [q_a | kv | comp kv | comp gate | indexer kv | indexer gate | indexer weights] in one GEMM
    # per run of same-kind weights (``fp8.merge_weights``), each with its parts' widths
    xproj: list[tuple[Weight, tuple[int, ...]]] = field(default_factory=list)


class SlotPool:
    """The slot state of a ``DeepseekV4ForCausalLM``: ``max_slots`` sequences of up to
    ``max_tokens`` tokens, in the model's device and dtype (module docstring)."""

    def __init__(self, model, max_slots: int, max_tokens: int) -> None:
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.max_slots, self.max_tokens = max_slots, max_tokens
        self.scratch = max_slots
        s1 = max_slots + 1
        self.layers: list[LayerPool] = []
        with torch.inference_mode():
            for layer in model.model.layers:
                attn: Attention = layer.self_attn
                swa = torch.zeros(s1, attn.window, attn.head_dim, dtype=self.dtype, device=self.device)
                comp = index = None
                if attn.compressor is not None:
                    comp = self._comp_pool(attn.compressor, s1)
                    if attn.indexer is not None:
                        index = self._comp_pool(attn.indexer, s1)
                self.layers.append(LayerPool(swa, comp, index))
        self.num_tokens = [0] * max_slots
        self.token_ids: list[list[int]] = [[] for _ in range(max_slots)]

    def _comp_pool(self, comp: Compressor, s1: int) -> CompPool:
        r, d, p = comp.rate, comp.width, comp.kv_proj.out_features
        tc = self.max_tokens // r
        dev, dt = self.device, self.dtype
        gate_dtype = torch.promote_types(dt, comp.position_bias.dtype)  # gates + bias, as Compressor.update
        return CompPool(
            rows=torch.zeros(s1, tc + 1, d, dtype=dt, device=dev),
            buf_kv=torch.zeros(s1, r, p, dtype=dt, device=dev),
            buf_gate=torch.zeros(s1, r, p, dtype=dt, device=dev),
            overlap_kv=torch.zeros(s1, r, d, dtype=dt, device=dev) if comp.overlap else None,
            overlap_gate=torch.zeros(s1, r, d, dtype=gate_dtype, device=dev) if comp.overlap else None,
        )

    def nbytes(self) -> int:
        """Bytes of the state tensors (not the step's weights)."""
        total = 0
        for lp in self.layers:
            ts = [lp.swa]
            for c in (lp.comp, lp.index):
                if c is not None:
                    ts += [t for t in (c.rows, c.buf_kv, c.buf_gate, c.overlap_kv, c.overlap_gate) if t is not None]
            total += sum(t.numel() * t.element_size() for t in ts)
        return total

    @torch.inference_mode()
    def load(self, slot: int, state: SequenceState) -> None:
        """Copy a general-path state (after prefill) into ``slot``."""
        n = state.num_tokens
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside [0, {self.max_slots})")
        if n >= self.max_tokens:
            raise ValueError(f"state of {n} tokens leaves no room in a {self.max_tokens}-token slot")
        for layer, ls, lp in zip(self.model.model.layers, state.layers, self.layers):
            attn = layer.self_attn
            w = attn.window
            m = min(ls.swa.shape[0], w - 1, n)
            if m:
                at = torch.arange(n - m, n, device=self.device) % w
                lp.swa[slot, at] = ls.swa[ls.swa.shape[0] - m :].to(self.dtype)
            for comp, cs, cp in ((attn.compressor, ls.comp, lp.comp), (attn.indexer, ls.index, lp.index)):
                if comp is None:
                    continue
                t = cs.rows.shape[0]
                if cs.windows is not None or t * comp.rate + cs.buf_kv.shape[0] != n:
                    raise ValueError("only states in the normal (non-replay) compressor mode can be loaded")
                cp.rows[slot, :t] = cs.rows
                nb = cs.buf_kv.shape[0]
                cp.buf_kv[slot, :nb] = cs.buf_kv
                cp.buf_gate[slot, :nb] = cs.buf_gate
                if comp.overlap and cs.overlap_kv is not None:
                    cp.overlap_kv[slot] = cs.overlap_kv
                    cp.overlap_gate[slot] = cs.overlap_gate
        self.num_tokens[slot] = n
        self.token_ids[slot] = list(state.token_ids)

    @torch.inference_mode()
    def export(self, slot: int) -> SequenceState:
        """``slot``'s state as a general-path ``SequenceState`` (copies)."""
        n = self.num_tokens[slot]
        layers = []
        for layer, lp in zip(self.model.model.layers, self.layers):
            attn = layer.self_attn
            w = attn.window
            m = min(n, w - 1)
            ls = LayerState(swa=lp.swa[slot, torch.arange(n - m, n, device=self.device) % w].clone())
            for name, comp, cp in (("comp", attn.compressor, lp.comp), ("index", attn.indexer, lp.index)):
                if comp is None:
                    continue
                t = n // comp.rate
                nb = n - t * comp.rate
                cs = CompressorState(cp.rows[slot, :t].clone(), cp.buf_kv[slot, :nb].clone(), cp.buf_gate[slot, :nb].clone())
                if comp.overlap and t:
                    cs.overlap_kv, cs.overlap_gate = cp.overlap_kv[slot].clone(), cp.overlap_gate[slot].clone()
                setattr(ls, name, cs)
            layers.append(ls)
        return SequenceState(layers, n, list(self.token_ids[slot]))

    def free(self, slot: int) -> None:
        """Forget ``slot``'s sequence (its tensors are overwritten by the next ``load``)."""
        self.num_tokens[slot] = 0
        self.token_ids[slot] = []
