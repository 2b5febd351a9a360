"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed long-range rows.

Every layer attends over its last ``W`` tokens (one shared key=value head, per-head sinks).
CSA layers add rows compressing every ``r=4`` tokens (overlapping windows of ``2r``) of which a
lightning indexer picks the top-k per query; HCA layers add one row per ``r=128`` tokens, all
visible. Projections run on all tokens of a batch at once; the sequence-local parts (window,
compressors, indexer) run per sequence (``_attend_sequence``: the reference every slot decoder's
step is tested against), so different lengths batch freely.

Attention itself (``attend_with_sinks``) gives every query its own key list: its ``W`` window
keys (an ``unfold`` view of the chunk's keys, no copy) and its compressed rows (CSA: the top-k
gathered; HCA: all rows, shared), so no score is computed for a key the query cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from kernels.prefill import PREFILL, PrefillTuning
from kernels.reference import attend_with_sinks, hide
from engine.model.config import CSA, SLIDING, ModelConfig
from engine.model.layers import GroupedLinear, RMSNorm, unweighted_rms_norm
from engine.model.rope import Rotary, apply_rope
from engine.model.state import CompressorState, LayerState

QUERY_TILE = 512  # queries per attention tile in long prefills (bounds the score matrix)


@dataclass
class SeqSlice:
    """One sequence's tokens inside the flattened batch: rows ``[start, end)``, state to update."""

    state: LayerState
    start: int
    end: int
    first_pos: int  # absolute position of row ``start``


class Projected(NamedTuple):
    """One layer's per-token projections of the whole batch (N tokens), roped where needed."""

    q: torch.Tensor  # (N, nh, D)
    kv: torch.Tensor  # (N, D)
    comp_kv: torch.Tensor | None  # (N, proj) compressor input series (CSA/HCA)
    comp_gate: torch.Tensor | None  # (N, proj)
    idx_kv: torch.Tensor | None  # (N, 2Di) indexer compressor input (CSA)
    idx_gate: torch.Tensor | None  # (N, 2Di)
    idx_q: torch.Tensor | None  # (N, Hi, Di) indexer queries
    idx_w: torch.Tensor | None  # (N, Hi) indexer head weights


class Compressor(nn.Module):
    """Gated pooling of every ``rate`` tokens into one normalised, rotated row of ``width``.

    ``overlap`` (CSA): each token projects two series, Ca ``[:width]`` and Cb ``[width:]``; row ``w``
    pools window ``w-1``'s Ca with window ``w``'s Cb over ``2·rate`` slots (softmax of gates).
    """

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        proj = 2 * width if overlap else width
        self.kv_proj = nn.Linear(hidden, proj, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, proj, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, proj, dtype=torch.float32))
        self.kv_norm = RMSNorm(width, eps)
        self.width, self.rate, self.overlap = width, rate, overlap

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> CompressorState:
        proj = self.kv_proj.out_features
        return CompressorState(
            rows=torch.empty(0, self.width, dtype=dtype, device=device),
            buf_kv=torch.empty(0, proj, dtype=dtype, device=device),
            buf_gate=torch.empty(0, proj, dtype=dtype, device=device),
        )

    def update(self, st: CompressorState, kv: torch.Tensor, gate: torch.Tensor, rotary: Rotary, fast: bool = False) -> None:
        """Append the rows of every window closed by the new tokens' ``kv, gate (S, proj)``.
        ``fast`` (the Triton prefill path): pooling, norm and RoPE in two kernels (``_rows_fast``)."""
        r = self.rate
        if st.journal is not None:
            st.journal.append((kv, gate))
        done = st.rows.shape[0] if st.windows is None else st.windows
        first_pos = done * r
        if st.buf_kv.shape[0] or not fast:  # fast: no copy of the projections when nothing is buffered
            kv = torch.cat([st.buf_kv, kv])
            gate = torch.cat([st.buf_gate, gate])
        usable = (kv.shape[0] // r) * r
        st.buf_kv, st.buf_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return
        n = usable // r
        if fast and (not self.overlap or st.overlap_kv is None):
            rotated = self._rows_fast(st, kv[:usable], gate[:usable], first_pos, rotary)
        else:
            rotated = self._rows(st, kv[:usable], gate[:usable], first_pos, rotary)
        present = st.rows.shape[0] - done  # rows of these windows already stored (replay)
        if present < n:
            st.rows = torch.cat([st.rows, rotated[max(present, 0) :]])
        done += n
        st.windows = None if done >= st.rows.shape[0] else done

    def _rows(self, st: CompressorState, kv: torch.Tensor, gate: torch.Tensor, first_pos: int, rotary: Rotary) -> torch.Tensor:
        """The rotated rows ``(n, d)`` of the ``n`` windows in ``kv, gate (n·r, proj)`` (PyTorch);
        CSA: updates the overlap state."""
        r, d = self.rate, self.width
        n = kv.shape[0] // r
        ckv = kv.view(n, r, -1)  # (n, r, proj)
        cgate = gate.view(n, r, -1) + self.position_bias  # (n, r, proj) fp32
        if self.overlap:
            pool_kv = ckv.new_zeros(n, 2 * r, d)
            pool_gate = cgate.new_full((n, 2 * r, d), float("-inf"))
            pool_kv[:, r:] = ckv[..., d:]
            pool_gate[:, r:] = cgate[..., d:]
            pool_kv[1:, :r] = ckv[:-1, :, :d]
            pool_gate[1:, :r] = cgate[:-1, :, :d]
            if st.overlap_kv is not None:
                pool_kv[0, :r] = st.overlap_kv.to(pool_kv.dtype)
                pool_gate[0, :r] = st.overlap_gate.to(pool_gate.dtype)
            st.overlap_kv = ckv[-1, :, :d].clone()
            st.overlap_gate = cgate[-1, :, :d].clone()
        else:
            pool_kv, pool_gate = ckv, cgate
        pooled = (pool_kv * pool_gate.softmax(dim=1, dtype=torch.float32).to(pool_kv.dtype)).sum(dim=1)
        rows = self.kv_norm(pooled)  # (n, d)
        positions = torch.arange(n, device=rows.device) * r + first_pos
        cos, sin = rotary.cos_sin(positions, rows.dtype)
        return apply_rope(rows, cos, sin)

    def _rows_fast(self, st: CompressorState, kv: torch.Tensor, gate: torch.Tensor, first_pos: int, rotary: Rotary) -> torch.Tensor:
        """``_rows`` through ``kernels.compressor.gated_pool`` and one ``fused.norm_rope`` pass (the
        PyTorch version launches ~40 kernels per call). CSA: only without a previous chunk's
        overlap (a fresh sequence): window ``i`` pools window ``i-1``'s first series."""
        from kernels import fused as fk
        from kernels.compressor import gated_pool

        r, d = self.rate, self.width
        usable = kv.shape[0]
        starts = torch.arange(0, usable, r, device=kv.device)
        prev = starts - r if self.overlap else None  # -r: the first window has none
        pooled = gated_pool(kv, gate, self.position_bias, starts, prev, self.overlap)  # (n, d)
        cos_tab, sin_tab = rotary.table(first_pos + usable, pooled.dtype, pooled.device)
        rotated = fk.norm_rope(pooled[:, None], self.kv_norm.weight, 1, self.kv_norm.eps, cos_tab, sin_tab, starts + first_pos)[:, 0]
        if self.overlap:  # the last window's first series for the next chunk, as ``_rows`` keeps it
            st.overlap_kv = kv[usable - r :, :d].clone()
            st.overlap_gate = gate[usable - r :, :d] + self.position_bias[:, :d]
        return rotated


class IndexerScorer(nn.Module):
    """Per-head weights of the lightning indexer's score ``Σ_h w_h · relu(q_h · k)``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False, dtype=dtype)


class Indexer(Compressor):
    """CSA's lightning indexer: its own compressor at ``index_head_dim`` plus a query head set."""

    def __init__(self, cfg: ModelConfig, rate: int, dtype: torch.dtype) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.rms_norm_eps, dtype)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False, dtype=dtype)
        self.scorer = IndexerScorer(cfg, dtype)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.softmax_scale = cfg.index_head_dim**-0.5
        self.weights_scaling = cfg.index_n_heads**-0.5

    def scores(self, q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``Σ_h w_h · relu(q_h · row_t)`` in fp32: ``q (..., Hi, Di)``, ``weights (..., Hi)`` and
        ``rows (T, Di)`` (shared) or ``(..., T, Di)`` (per leading index) → ``(..., T)``."""
        keys = rows.float().t().contiguous() if rows.dim() == 2 else rows.float().transpose(-1, -2)  # (Di, T): BLAS's fast layout
        scores = torch.matmul(q.float(), keys)  # (..., Hi, T)
        scores = scores.relu_().mul_(self.softmax_scale)
        # the weights are scaled before they meet the scores, in transformers' order
        return scores.mul_((weights.float() * self.weights_scaling).unsqueeze(-1)).sum(dim=-2)

    def topk_rows(self, q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's top-k causal rows: indices ``(S, k)`` into ``rows (T, Di)`` and ``(S, k)``
        True where the chosen row is complete at the query's position."""
        t = rows.shape[0]
        threshold = (positions + 1) // self.rate  # (S,) rows < threshold are complete
        future = torch.arange(t, device=rows.device)[None, :] >= threshold[:, None]
        scores = self.scores(q, weights, rows).masked_fill(future, float("-inf"))  # (S, T)
        # torch.topk over all rows so far, future rows at -inf, exactly as transformers does: with
        # exact score ties (few indexer heads, relu zeros) its tie order depends on the row count,
        # so chunked and one-shot prefill may pick different tied rows, in transformers as here.
        top = scores.topk(min(self.topk, t), dim=-1).indices  # (S, k)
        return top, top < threshold[:, None]


class Attention(nn.Module):
    """One layer's attention (sliding, CSA or HCA), parameter names as in transformers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, prefill: PrefillTuning = PREFILL) -> None:
        super().__init__()
        self.prefill = prefill  # the Triton prefill path's launches (``kernels.prefill``)
        self.layer_type = cfg.layer_types[layer_idx]
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.scaling = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.o_groups = cfg.o_groups
        h, qr = cfg.hidden_size, cfg.q_lora_rank
        self.q_a_proj = nn.Linear(h, qr, bias=False, dtype=dtype)
        self.q_a_norm = RMSNorm(qr, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(qr, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.kv_proj = nn.Linear(h, self.head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dtype)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        # Triton prefill (kernels/prefill.py, fused norm+RoPE): None = on CUDA in bf16/fp16,
        # True = wherever Triton runs (CUDA, or its CPU interpreter), False = never
        self.fast_prefill: bool | None = None
        self.compressor: Compressor | None = None
        if self.layer_type != SLIDING:
            rate = cfg.compress_rate(self.layer_type)
            self.compressor = Compressor(h, self.head_dim, rate, self.layer_type == CSA, cfg.rms_norm_eps, dtype)
            if self.layer_type == CSA:
                self.compressor.indexer = Indexer(cfg, rate, dtype)

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None) if self.compressor is not None else None

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> LayerState:
        st = LayerState(swa=torch.empty(0, self.head_dim, dtype=dtype, device=device))
        if self.compressor is not None:
            st.comp = self.compressor.empty_state(dtype, device)
        if self.indexer is not None:
            st.index = self.indexer.empty_state(dtype, device)
        return st

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: Rotary,
        seqs: list[SeqSlice],
    ) -> torch.Tensor:
        """``x (N, H)`` normalised block input → ``(N, H)``; updates each sequence's state (each
        sequence through ``_attend_sequence``)."""
        if self.use_fast_prefill(x):
            return self._forward_fast(x, positions, rope, rotary, seqs)
        return self.project_attend(x, rope, lambda p: self._attend_all(seqs, p, positions, rotary, fast=False))

    def project_attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Callable[[Projected], torch.Tensor]) -> torch.Tensor:
        """``x (N, H)`` → ``(N, H)``: the projections, ``attend`` (→ ``(N, nh, D)``, updating whatever
        state it keeps), the values' rotation undone, the output projection."""
        cos, sin = rope
        out = attend(self._project(x, rope))
        return self._output(apply_rope(out, cos, -sin))  # undo the rotation values picked up as keys

    def _attend_all(self, seqs: list[SeqSlice], p: Projected, positions: torch.Tensor, rotary: Rotary, fast: bool) -> torch.Tensor:
        """Attention output ``(N, nh, D)``: every sequence through ``_attend_sequence`` (``fast``:
        its attention and top-k through ``kernels.prefill``)."""
        if len(seqs) == 1:  # one chunk: its output is the whole output
            return self._attend_sequence(seqs[0], p, positions, rotary, fast=fast)
        out = torch.empty_like(p.q)
        for s in seqs:
            out[s.start : s.end] = self._attend_sequence(s, p, positions, rotary, fast=fast)
        return out

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped output projection of the attention output ``(N, nh, D)`` → ``(N, H)``."""
        grouped = self.o_a_proj(out.reshape(out.shape[0], self.o_groups, -1)).flatten(1)  # (N, G*o_lora)
        return self.o_b_proj(grouped)

    def use_fast_prefill(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` takes the Triton path (``fast_prefill``; CPU stays on the exact path)."""
        if self.fast_prefill is False or not (x.is_cuda or x.device.type == "cpu" and self.fast_prefill):
            return False
        from kernels._common import use_triton

        return use_triton(x) and (self.fast_prefill is True or x.dtype in (torch.bfloat16, torch.float16))

    def _forward_fast(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: Rotary,
        seqs: list[SeqSlice],
    ) -> torch.Tensor:
        """``forward`` through Triton: fused head norm + RoPE, flash attention over each query's
        window and compressed rows, fused indexer scores (``kernels.prefill``)."""
        from kernels import fused as fk
        from kernels import prefill as kp

        n = x.shape[0]
        cos, sin = rope
        at = torch.arange(n, device=x.device)  # row of each token in the cos/sin tables
        # one sequence: the output's RoPE undo (default, fold_norm_rope 3) and optionally the q
        # norm + RoPE (1, 2) run inside the attention kernel, a pass over (N, nh, D) fewer each
        fold = self.prefill.fold_norm_rope if len(seqs) == 1 else 0
        p = self._project_fast(x, rope, at, fold_q=fold in (1, 2))
        if fold:
            return self._output_fast(self._attend_sequence(seqs[0], p, positions, rotary, fast=True, rope=rope, fold=fold))
        out = self._attend_all(seqs, p, positions, rotary, fast=True)
        undo = fk.norm_rope(out, None, 0, 0.0, cos, sin, at, sign=-1.0, tuning=self.prefill.norm_rope)  # undo the values' rotation
        return self._output_fast(undo)

    def _output_fast(self, out: torch.Tensor) -> torch.Tensor:
        """``_output`` with the grouped product written straight into ``(N, G, o_lora)`` rows
        (a transposed ``bmm`` output), so no ``(N, G·o_lora)`` copy is made before ``o_b_proj``."""
        n = out.shape[0]
        return self.o_b_proj(self.o_a_proj.rows(out.reshape(n, self.o_groups, -1)).view(n, -1))

    def _project_fast(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], at: torch.Tensor, fold_q: bool = False
    ) -> Projected:
        """``_project`` with the head norms and RoPE as one Triton pass each (``fused.norm_rope``);
        ``fold_q``: ``q`` stays the raw projection (the attention kernel normalises and rotates it)."""
        from kernels import fused as fk

        n = x.shape[0]
        cos, sin = rope
        nr = self.prefill.norm_rope
        q_res = fk.norm_rope(self.q_a_proj(x)[:, None], self.q_a_norm.weight, 1, self.q_a_norm.eps, tuning=nr)[:, 0]  # (N, qr)
        q = self.q_b_proj(q_res).view(n, self.n_heads, self.head_dim)
        if not fold_q:
            q = fk.norm_rope(q, None, 2, self.eps, cos, sin, at, tuning=nr)
        kv = fk.norm_rope(self.kv_proj(x)[:, None], self.kv_norm.weight, 1, self.kv_norm.eps, cos, sin, at, tuning=nr)[:, 0]
        comp_kv = comp_gate = idx_kv = idx_gate = idx_q = idx_w = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.kv_proj(x), self.compressor.gate_proj(x)
        idx = self.indexer
        if idx is not None:
            idx_kv, idx_gate = idx.kv_proj(x), idx.gate_proj(x)
            idx_q = fk.norm_rope(idx.q_b_proj(q_res).view(n, idx.n_heads, idx.width), None, 0, 0.0, cos, sin, at, tuning=nr)
            idx_w = idx.scorer.weights_proj(x)  # (N, Hi)
        return Projected(q, kv, comp_kv, comp_gate, idx_kv, idx_gate, idx_q, idx_w)

    def _project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> Projected:
        n = x.shape[0]
        cos, sin = rope
        q_res = self.q_a_norm(self.q_a_proj(x))  # (N, qr)
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(n, self.n_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)  # (N, nh, D)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # (N, D)
        comp_kv = comp_gate = idx_kv = idx_gate = idx_q = idx_w = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.kv_proj(x), self.compressor.gate_proj(x)
        idx = self.indexer
        if idx is not None:
            idx_kv, idx_gate = idx.kv_proj(x), idx.gate_proj(x)
            idx_q = apply_rope(idx.q_b_proj(q_res).view(n, idx.n_heads, idx.width), cos, sin)
            idx_w = idx.scorer.weights_proj(x)  # (N, Hi)
        return Projected(q, kv, comp_kv, comp_gate, idx_kv, idx_gate, idx_q, idx_w)

    def _attend_sequence(
        self, s: SeqSlice, p: Projected, positions: torch.Tensor, rotary: Rotary, fast: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None, fold: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """The general path: one sequence's chunk of any length → ``(S, nh, D)``; updates its state.

        The window keys and the compressors' rows are this method's; the attention itself is the
        reference (``attend_with_sinks`` over 512-query tiles, ``Indexer.topk_rows``) or, ``fast``
        (the Triton prefill path), ``kernels.prefill``'s kernels (no score tensor, no tile loop;
        ``fold`` = ``PrefillTuning.fold_norm_rope`` with the ``rope`` tables: 1/2 = ``p.q`` is raw,
        its norm + RoPE and the output's RoPE undo run in the kernel; 3 = only the undo)."""
        a, b, st = s.start, s.end, s.state
        pos = positions[a:b]
        keys, pad = self._window_keys(st, p.kv[a:b])  # (W-1+S, D), left padding
        rows = None
        idx = self.indexer
        if self.compressor is not None:
            self.compressor.update(st.comp, p.comp_kv[a:b], p.comp_gate[a:b], rotary, fast=fast)
            if idx is not None:
                idx.update(st.index, p.idx_kv[a:b], p.idx_gate[a:b], rotary, fast=fast)
            if st.comp.rows.shape[0]:
                rows = st.comp.rows  # (T, D)
        if fast:
            return self._attend_kernels(p, a, b, pos, keys, pad, rows, st, rope, fold)
        win = keys.unfold(0, self.window, 1).transpose(1, 2)  # (S, W, D) view: query i sees padded rows i .. i+W-1
        win_bias = None
        if pad:
            i = torch.arange(b - a, device=keys.device)[:, None]
            win_bias = hide(i + torch.arange(self.window, device=keys.device)[None, :] < pad, keys.dtype)
        row_bias = None
        if rows is not None and idx is None:  # HCA: every complete row
            visible = torch.arange(rows.shape[0], device=rows.device)[None, :] < ((pos + 1) // self.compressor.rate)[:, None]
            row_bias = hide(~visible, p.q.dtype)  # (S, T)
        out = torch.empty_like(p.q[a:b])
        for t0 in range(0, b - a, QUERY_TILE):
            t = slice(t0, min(t0 + QUERY_TILE, b - a))
            extra, extra_bias = rows, None if row_bias is None else row_bias[t]
            if rows is not None and idx is not None:  # CSA: gather each query's top-k rows
                top, valid = idx.topk_rows(p.idx_q[a:b][t], p.idx_w[a:b][t], st.index.rows, pos[t])  # (s, k)
                extra, extra_bias = rows[top], hide(~valid, p.q.dtype)  # (s, k, D), (s, k)
            wb = None if win_bias is None else win_bias[t]
            out[t] = attend_with_sinks(p.q[a:b][t], win[t], wb, extra, extra_bias, self.sinks, self.scaling)
        return out

    def _attend_kernels(
        self, p: Projected, a: int, b: int, pos: torch.Tensor, keys: torch.Tensor, pad: int, rows: torch.Tensor | None,
        st: LayerState, rope: tuple[torch.Tensor, torch.Tensor] | None, fold: int,
    ) -> torch.Tensor:  # fmt: skip
        """``_attend_sequence``'s attention through ``kernels.prefill`` (``prefill_topk``,
        ``prefill_attention``) over the padded window ``keys`` and the compressed ``rows``."""
        from kernels import prefill as kp

        row_len = top = None
        idx = self.indexer
        if rows is not None:
            row_len = torch.div(pos + 1, self.compressor.rate, rounding_mode="floor")
            if idx is not None:
                scale = idx.softmax_scale * idx.weights_scaling
                top = kp.prefill_topk(p.idx_q[a:b], p.idx_w[a:b], st.index.rows, row_len, idx.topk, scale, self.prefill.indexer)
        kw = {}
        if rope is not None and fold:
            tables = (rope[0][a:b], rope[1][a:b])
            kw = {"q_norm_eps": self.eps, "rope": tables, "fold_q": fold if fold in (1, 2) else 0}
        return kp.prefill_attention(
            p.q[a:b], keys, pad, self.sinks, self.window, rows, row_len, top, self.scaling, **kw, tuning=self.prefill.attention
        )

    def _window_keys(self, st: LayerState, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The chunk's window keys ``(W-1+S, D)``: the previous ``W-1`` keys left-padded with
        ``pad`` zero rows, then the new ones (query ``i`` sees rows ``i .. i+W-1``); updates
        ``st.swa``. → ``(keys, pad)``."""
        keep = self.window - 1
        prev = st.swa[max(0, st.swa.shape[0] - keep) :]
        pad = keep - prev.shape[0]
        keys = torch.cat([kv.new_zeros(pad, kv.shape[-1]), prev, kv])  # (W-1+S, D)
        real = min(prev.shape[0] + kv.shape[0], keep)
        st.swa = keys[keys.shape[0] - real :].clone()  # (≤ W-1, D), not a view of the chunk
        return keys, pad
