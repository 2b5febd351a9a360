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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.model import slot_rewind
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


class PendingVerify(NamedTuple):
    """A verify step awaiting ``SlotPool.accept``: its slots, their positions before it, the tokens
    fed, the padded batch and the entries it may have overwritten (``slot_rewind.snapshot``)."""

    slots: list[int]
    positions: list[int]
    rows: list[list[int]]
    batch: int
    snap: list[torch.Tensor]


class SlotPool:
    """The slot state of a ``DeepseekV4ForCausalLM``: ``max_slots`` sequences of up to
    ``max_tokens`` tokens, in the model's device and dtype (module docstring); ``verify_width``:
    the tokens per slot a verify step may feed (``slot_rewind`` undoes at most one window close)."""

    def __init__(self, model, max_slots: int, max_tokens: int, verify_width: int = 1) -> None:
        rates = [layer.self_attn.compressor.rate for layer in model.model.layers if layer.self_attn.compressor is not None]
        if verify_width > 1 and (verify_width > min(rates, default=verify_width) or verify_width >= model.config.sliding_window):
            raise ValueError(f"a verify of {verify_width} tokens per slot needs at most the smallest compression rate and fewer than the window")
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
        self.windows = [layer.self_attn.window for layer in model.model.layers]
        self.pending: PendingVerify | None = None  # a verify awaiting ``accept``

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
        assert self.pending is None, "accept the pending verify first"
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

    # ---- a step's bookkeeping (every backend's step calls these) ----------------------------
    def check(self, slots: Sequence[int], token_ids: Sequence[int], empty_ok: bool = False) -> None:
        """``ValueError`` unless there is one token per slot, each slot once and not full."""
        assert self.pending is None, "accept the pending verify first"
        n = len(slots)
        if n != len(token_ids) or (n == 0 and not empty_ok):
            raise ValueError("one token per slot, at least one slot")
        for s in slots:
            if self.num_tokens[s] >= self.max_tokens:
                raise ValueError(f"slot {s} is full ({self.max_tokens} tokens)")
        if len(set(slots)) != n:
            raise ValueError("a slot appears twice in one step")

    def check_verify(self, slots: Sequence[int], token_rows: Sequence[Sequence[int]], width: int, vocab_size: int) -> list[int]:
        """``ValueError`` unless each slot gets ``width`` tokens in range and has room for them;
        the slots' positions."""
        if width < 2 or len(token_rows) != len(slots) or any(len(r) != width for r in token_rows):
            raise ValueError(f"a verify feeds {width} tokens per slot (verify_width)")
        self.check(slots, [r[0] for r in token_rows])
        if any(not 0 <= t < vocab_size for r in token_rows for t in r):
            raise ValueError(f"token id out of range [0, {vocab_size})")
        for s in slots:
            if self.num_tokens[s] + width > self.max_tokens:
                raise ValueError(f"slot {s} has no room for {width} more tokens ({self.max_tokens})")
        return [self.num_tokens[s] for s in slots]

    def advance(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """After a step: each slot holds one more token."""
        for s, t in zip(slots, token_ids):
            self.num_tokens[s] += 1
            self.token_ids[s].append(int(t))

    @torch.inference_mode()
    def accept(self, kept: Sequence[int], width: int) -> None:
        """End the pending verify of ``width`` tokens per slot: slot ``i`` keeps its first
        ``kept[i]`` tokens (``1 .. width``); what the others wrote is undone (``slot_rewind``)."""
        assert self.pending is not None, "no verify to accept"
        slots, positions, rows, b, snap = self.pending
        if len(kept) != len(slots) or any(not 1 <= k <= width for k in kept):
            raise ValueError(f"kept counts {list(kept)} for {len(slots)} slots of {width} tokens")
        self.pending = None
        slot_rewind.restore(self.layers, self.windows, snap, slots, positions, kept, b, width)
        for s, p, r, k in zip(slots, positions, rows, kept):
            self.num_tokens[s] = p + k
            self.token_ids[s].extend(r[:k])


class PooledDecoder:
    """The state half of the ``SlotDecoder`` protocol for a decoder that holds its slots in a
    ``SlotPool`` as ``self.slots`` (``StaticDecoder``, ``HostDecoder``): each call is the pool's."""

    slots: SlotPool

    def nbytes(self) -> int:
        """Bytes of the slot state (``SlotPool.nbytes``)."""
        return self.slots.nbytes()

    def load(self, slot: int, state: SequenceState) -> None:
        """Copy a general-path state (after prefill) into ``slot`` (``SlotPool.load``)."""
        self.slots.load(slot, state)

    def export(self, slot: int) -> SequenceState:
        """``slot``'s state as a general-path ``SequenceState`` (copies; ``SlotPool.export``)."""
        return self.slots.export(slot)

    def free(self, slot: int) -> None:
        """Forget ``slot``'s sequence (``SlotPool.free``)."""
        self.slots.free(slot)
