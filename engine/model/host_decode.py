"""Slot decode on the CPU: the static decoder's slot pools, stepped with the lengths the host knows.

The general path keeps each sequence's state in its own tensors and attends sequence by sequence
(``Attention._attend_sequence``), per-sequence work that grows with the batch
(``bench.engine_bench --general-path``). Here the state lives
in a ``slots.SlotPool`` (the layout ``StaticDecoder`` steps too; ``load``/``export``/``free``), and a step is
batched tensor ops with no per-sequence loop:

- each compressor buffers the token at ``p % r``; only the rows whose window closes this step
  (known on the host) pool it and write row ``p // r`` (``cpu_slots.compress_step``, the tokens in
  column order);
- HCA reads rows ``[0, max count)`` of each slot (bias on the shorter ones), CSA scores as many
  indexer rows and picks with ``decode.pick_rows`` (compiled: ``cpu_slots.top_rows``);
- one ``cpu_slots.gather_attend`` for the batch reads the window from the ring (positions
  ``p-W+1 .. p-1``) and the step's own new keys, then the new keys go into the ring at ``p % W``.

A verify step (``1 + k`` tokens per slot, offset-major columns) is the same pass over all its
columns: the compressors take the offsets in order, and offset ``j`` of a slot attends to the
ring up to position ``p-1`` and the new keys of offsets ``0 .. j`` (``gather_attend``'s fresh
keys), so no offset's ring write replaces a key an earlier offset reads.

Unlike the CUDA-graph path, nothing is padded to a bucket and no shape is fixed: the host knows
every position, so a step reads only the rows that exist. The attention and the compressors are
always these compiled loops (fp32 only); with ``compiled`` (the default) the rest of each layer is
too (the mHC, projections, output projection and MoE through ``cpu_layer.decode_layer``), else the
general path's own modules (``DecoderLayer.blocks``, ``Attention.project_attend``) run it
(``bench.engine_bench --eager-slots``). Either way the tokens and logprobs equal the general
path's within fp32 rounding (the tests compare both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.model import cpu_layer, cpu_slots, slot_rewind
from engine.model.attention import Attention, Compressor, Indexer, Projected
from engine.model.decode import pad_bias, pick_rows
from engine.model.fp8 import keeps_native_weights
from engine.model.layers import replicate_streams
from engine.model.rope import Rotary
from engine.model.slots.pool import CompPool, LayerPool, PendingVerify, PooledDecoder, SlotPool


@dataclass
class _RateStep:
    """One step's indices for the compressors of one rate ``r`` (module docstring)."""

    buf_at: torch.Tensor  # (n,) flat buffer row of each token: slot * r + p % r
    row_base: torch.Tensor  # (n,) flat row 0 of each slot: slot * (Tc + 1)
    counts: list[int]  # complete rows of each sequence after this step
    close: list[int]  # columns whose window closes this step (ascending)
    close_slots: torch.Tensor | None  # (m,)
    close_rows: torch.Tensor | None  # (m,) flat destination row of each closing window
    close_pos: torch.Tensor | None  # (m,) position of each closing window's row (window * r)
    has_prev: torch.Tensor | None  # (m, 1, 1) window > 0, None when all are
    host: cpu_slots.ClosingWindows | None = None  # the above as numpy arrays, made once per step


@dataclass
class _Step:
    """One step's indices shared by every layer (``cols`` columns per offset, offset-major)."""

    slots: torch.Tensor  # (n,) int64
    positions: torch.Tensor  # (n,) position of each new token
    ring_at: torch.Tensor  # (n,) flat ring entry of the new key: slot * W + p % W
    rates: dict[int, _RateStep]
    cols: int


class HostDecoder(PooledDecoder):
    """A ``SlotPool`` stepped on the CPU (module docstring; ``slots.SlotDecoder``): ``step``
    returns final hidden states ``(n, H)`` for ``model.head`` (its exact int8-screened greedy
    argmax, or logits)."""

    output = "hidden"

    def __init__(self, model, max_slots: int, max_tokens: int, compiled: bool = True, verify_width: int = 1) -> None:
        if keeps_native_weights(model):  # its compiled loops read the weights as dense numpy views
            raise ValueError("the host slot decoder needs dequantised weights: load with load_model(fp8=None, fp4_experts=False)")
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise ValueError("the host slot decoder runs fp32 CPU models (its compiled loops are fp32)")
        self.model, self.cfg, self.dtype = model, model.config, model.dtype
        self.max_slots, self.max_tokens, self.verify_width = max_slots, max_tokens, verify_width
        self.buckets = (max_slots,)  # nothing is padded: any batch runs as it is
        self.slots = SlotPool(model, max_slots, max_tokens, verify_width)
        self.pools, self.num_tokens, self.token_ids = self.slots.layers, self.slots.num_tokens, self.slots.token_ids
        self.compiled = compiled  # the layers through cpu_layer (attention and compressors are always cpu_slots)
        self._packed: list[cpu_layer.LayerWeights | None] | None = None
        self._comp_arrays: dict[int, cpu_slots.CompressArrays] = {}  # by id of the CompPool

    def accept(self, kept: Sequence[int]) -> None:
        """End the pending ``verify``: slot ``i`` keeps its first ``kept[i]`` tokens (``SlotPool.accept``)."""
        self.slots.accept(kept, self.verify_width)

    def capture_graphs(self) -> None:
        """No graphs on the host: compile the step's kernels now (``warm_up``)."""
        self.warm_up()

    @torch.inference_mode()
    def step(self, slots: Sequence[int], token_ids: Sequence[int], bucket: int | None = None) -> torch.Tensor:
        """One decode token per listed slot → the last hidden states ``(n, H)`` (``bucket`` is
        accepted for the runner's interface and ignored: nothing is padded here)."""
        self.slots.check(slots, token_ids)
        if any(not 0 <= t < self.cfg.vocab_size for t in token_ids):
            raise ValueError(f"token id out of range [0, {self.cfg.vocab_size})")
        streams, compiled = self._layers(slots, list(token_ids), [self.num_tokens[s] for s in slots], 1)
        self.slots.advance(slots, token_ids)
        return self._final(streams, compiled)

    @torch.inference_mode()
    def verify(self, slots: Sequence[int], token_rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``StaticDecoder.verify``'s contract on the host: ``verify_width`` tokens per slot in one pass of
        the layers over every column (module docstring) → hidden ``(n, width, H)`` and streams
        ``(n, width, hc, H)``; ``accept`` next."""
        width, n = self.verify_width, len(slots)
        positions = self.slots.check_verify(slots, token_rows, width, self.cfg.vocab_size)
        ids = [int(r[j]) for j in range(width) for r in token_rows]  # offset-major columns
        pos = [p + j for j in range(width) for p in positions]
        snap = slot_rewind.snapshot(self.pools, self.slots.windows, torch.tensor(pos), torch.tensor(list(slots) * width), n)
        streams, compiled = self._layers(slots, ids, pos, width)
        hidden = self._final(streams, compiled)
        self.slots.pending = PendingVerify(list(slots), positions, [list(r) for r in token_rows], n, snap)
        return hidden.view(width, n, -1).transpose(0, 1), streams.view(width, n, *streams.shape[1:]).transpose(0, 1)

    def _layers(self, slots: Sequence[int], token_ids: list[int], positions: list[int], width: int) -> tuple[torch.Tensor, bool]:
        """Every layer over offset-major columns (``width`` offsets of the slots) → the final
        streams ``(N, hc, H)`` and whether the compiled layers ran; writes the slots' state."""
        model, cfg = self.model, self.cfg
        step = self._indices(list(slots) * width, positions, len(slots))
        ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        embeds = model.model.embed_tokens(ids)  # (N, H)
        streams = replicate_streams(embeds, cfg.hc_mult)  # (N, hc, H)
        rotary = model.rotary["compress"]
        packed = self._layer_weights() if self.compiled else [None] * len(self.pools)
        compiled = any(w is not None for w in packed)
        if compiled:  # rows of the cached tables: two gathers instead of eight ops per variant
            top = max(positions) + 1
            ropes = {kind: tuple(t.index_select(0, pos) for t in rot.table(top, embeds.dtype, pos.device)) for kind, rot in model.rotary.items()}
        else:
            ropes = {kind: rot.cos_sin(pos, embeds.dtype) for kind, rot in model.rotary.items()}
        host = {kind: (c.numpy(), s.numpy()) for kind, (c, s) in ropes.items()} if compiled else {}
        for layer, lp, w in zip(model.model.layers, self.pools, packed):
            attn: Attention = layer.self_attn
            attend = lambda p, attn=attn, lp=lp: self._attend(attn, lp, p, step, rotary)
            if w is not None:
                streams = torch.from_numpy(cpu_layer.decode_layer(w, np.ascontiguousarray(streams.numpy()), ids.numpy(), *host[attn.rope_kind], attend))
            else:
                rope = ropes[attn.rope_kind]
                streams = layer.blocks(streams, ids, lambda x, attn=attn, rope=rope, attend=attend: attn.project_attend(x, rope, attend))
        return streams, compiled

    def _final(self, streams: torch.Tensor, compiled: bool) -> torch.Tensor:
        """The head's input ``(N, H)`` from the final streams (the compiled hyper-head and norm where the layers were compiled)."""
        if compiled:
            return cpu_layer.final_hidden(self.model, np.ascontiguousarray(streams.numpy()))
        return self.model.model.norm(self.model.model.hc_head(streams))

    def warm_up(self) -> None:
        """Compile the step's numba kernels now instead of on the first request (~15 s on a cold
        numba cache, well under a second from its on-disk cache): two 8-token sequences prefilled
        on the general path, two decode steps in the last two slots (CSA rows exist by then, so
        every kernel runs), the head's greedy pass on two rows and on one; the slots are freed."""
        if self.max_tokens < 16:
            return
        model = self.model
        slots = list(range(max(0, self.max_slots - 2), self.max_slots))
        states = [model.new_state() for _ in slots]
        with torch.inference_mode():
            model([(st, [1] * 8) for st in states])
            for slot, st in zip(slots, states):
                self.load(slot, st)
            for _ in range(2):
                hidden = self.step(slots, [1] * len(slots))
                model.head.argmax(hidden)
                model.head.argmax(hidden[:1])
        for slot in slots:
            self.free(slot)

    def _layer_weights(self) -> list[cpu_layer.LayerWeights | None]:
        """Each layer's weights for ``cpu_layer.decode_layer`` (None: the eager layer), packed on
        first use (views of the parameters: nothing to refresh after in-place writes)."""
        if self._packed is None:
            self._packed = [cpu_layer.pack(layer) for layer in self.model.model.layers]
        return self._packed

    def _indices(self, slots: Sequence[int], positions: list[int], cols: int) -> _Step:
        w = self.cfg.sliding_window
        slot_t = torch.tensor(slots, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        rates: dict[int, _RateStep] = {}
        for layer in self.model.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None and comp.rate not in rates:
                rates[comp.rate] = self._rate_step(comp.rate, slots, positions, slot_t, pos_t)
        return _Step(slot_t, pos_t, slot_t * w + pos_t % w, rates, cols)

    def _rate_step(self, r: int, slots: Sequence[int], positions: list[int], slot_t: torch.Tensor, pos_t: torch.Tensor) -> _RateStep:
        tc1 = self.max_tokens // r + 1
        close = [i for i, p in enumerate(positions) if p % r == r - 1]
        rs = _RateStep(slot_t * r + pos_t % r, slot_t * tc1, [(p + 1) // r for p in positions], close, None, None, None, None)
        if close:
            wins = [positions[i] // r for i in close]
            cs = [slots[i] for i in close]
            rs.close_slots = torch.tensor(cs, dtype=torch.long)
            rs.close_rows = torch.tensor([s * tc1 + k for s, k in zip(cs, wins)], dtype=torch.long)
            rs.close_pos = torch.tensor([k * r for k in wins], dtype=torch.long)
            if min(wins) == 0:
                rs.has_prev = torch.tensor(wins, dtype=torch.long).gt(0).view(-1, 1, 1)
        return rs

    def _attend(self, attn: Attention, lp: LayerPool, p: Projected, st: _Step, rotary: Rotary) -> torch.Tensor:
        """Attention of the step's columns over their slots → ``(n, nh, D)``; writes their state
        (the new keys into the ring after the attention has read the old ones)."""
        ring = lp.swa.view(-1, lp.swa.shape[-1])
        rows = row_at = row_bias = None  # compressed rows: flat pool, (n, E) row numbers, bias
        comp = attn.compressor
        if comp is not None:
            rs = st.rates[comp.rate]
            self._compress(comp, lp.comp, p.comp_kv, p.comp_gate, rs, rotary)
            idx = attn.indexer
            t = max(rs.counts)
            rows = lp.comp.rows.view(-1, comp.width)
            if idx is not None:
                self._compress(idx, lp.index, p.idx_kv, p.idx_gate, rs, rotary)
                if t:
                    flat = lp.index.rows.view(-1, lp.index.rows.shape[-1])
                    scores = cpu_slots.index_scores(p.idx_q, p.idx_w, flat, rs.row_base, t, idx.softmax_scale, idx.weights_scaling)  # (n, T)
                    chosen, row_bias = self._pick_rows(idx, scores, rs.counts, p.q.dtype)  # (n, k)
                    row_at = rs.row_base[:, None] + chosen
            elif t:
                row_at = rs.row_base[:, None] + torch.arange(t)  # (n, T)
                if min(rs.counts) < t:
                    row_bias = pad_bias(rs.counts, t, p.q.dtype, ring.device)
        w = self.cfg.sliding_window
        out = cpu_slots.gather_attend(p.q, ring, st.slots, st.positions, w, rows, row_at, row_bias, attn.sinks, attn.scaling, fresh=p.kv, cols=st.cols)
        ring.index_copy_(0, st.ring_at, p.kv)
        return out

    def _pick_rows(self, idx: Indexer, scores: torch.Tensor, counts: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``decode.pick_rows``: compiled (``cpu_slots.top_rows``: the same rows, tied ones lowest
        column first) except for the rows where a tie across the cut leaves the set to
        ``torch.topk``'s order (each row's pick depends on that row alone)."""
        chosen, taken, left = cpu_slots.top_rows(scores, counts, idx.topk)
        if left:
            rest, _ = pick_rows(idx, scores[left], [counts[i] for i in left], dtype)
            chosen[left, : rest.shape[1]] = rest
        k_max = chosen.shape[1]
        return chosen, None if min(taken) == k_max else pad_bias(taken, k_max, dtype, scores.device)

    def _compress(self, comp: Compressor, cp: CompPool, kv: torch.Tensor, gate: torch.Tensor, rs: _RateStep, rotary: Rotary) -> None:
        """Buffer the tokens' projections; pool the windows that close and store their rows
        (``cpu_slots.compress_step`` over numpy views made once (pools) or once per step (indices))."""
        if rs.host is None:  # the compressors of a rate share it
            cos = sin = None
            if rs.close:
                cos, sin = rotary.cos_sin(rs.close_pos, torch.float32)
            rs.host = cpu_slots.closing_windows(rs.buf_at, rs.close, rs.close_slots, rs.close_rows, rs.has_prev, cos, sin)
        arrays = self._comp_arrays.get(id(cp))
        if arrays is None:
            arrays = self._comp_arrays[id(cp)] = cpu_slots.compress_arrays(
                cp.rows, cp.buf_kv, cp.buf_gate, cp.overlap_kv, cp.overlap_gate, comp.position_bias,
                comp.kv_norm.weight, comp.kv_norm.eps,
            )  # fmt: skip
        cpu_slots.compress_step(arrays, rs.host, kv, gate)
