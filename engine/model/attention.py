"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed long-range rows.

Every layer attends over its last ``W`` tokens (one shared key=value head, per-head sinks).
CSA layers add rows compressing every ``r=4`` tokens (overlapping windows of ``2r``) of which a
lightning indexer picks the top-k per query; HCA layers add one row per ``r=128`` tokens, all
visible. Projections run on all tokens of a batch at once; the sequence-local parts (window,
compressors, indexer, attention itself) loop over sequences, so different lengths batch freely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import CSA, HCA, SLIDING, ModelConfig
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

    def update(self, st: CompressorState, kv: torch.Tensor, gate: torch.Tensor, rotary: Rotary) -> None:
        """Append the rows of every window closed by the new tokens' ``kv, gate (S, proj)``."""
        r, d = self.rate, self.width
        done = st.rows.shape[0] if st.windows is None else st.windows
        first_pos = done * r
        kv = torch.cat([st.buf_kv, kv])
        gate = torch.cat([st.buf_gate, gate])
        usable = (kv.shape[0] // r) * r
        st.buf_kv, st.buf_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return
        n = usable // r
        ckv = kv[:usable].view(n, r, -1)  # (n, r, proj)
        cgate = gate[:usable].view(n, r, -1) + self.position_bias  # (n, r, proj) fp32
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
        present = st.rows.shape[0] - done  # rows of these windows already stored (replay)
        if present < n:
            st.rows = torch.cat([st.rows, apply_rope(rows, cos, sin)[max(present, 0) :]])
        done += n
        st.windows = None if done >= st.rows.shape[0] else done


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

    def select(self, q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Additive bias ``(S, T)``: 0 on each query's top-k causal rows, -inf elsewhere."""
        t = rows.shape[0]
        scores = torch.matmul(q.float(), rows.t().float().unsqueeze(0))  # (S, Hi, T)
        scores = F.relu(scores) * self.softmax_scale
        scores = (scores * weights.float().unsqueeze(-1) * self.weights_scaling).sum(dim=1)  # (S, T)
        threshold = (positions + 1) // self.rate  # (S,) rows < threshold are complete
        future = torch.arange(t, device=rows.device)[None, :] >= threshold[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        # torch.topk over all rows so far, future rows at -inf, exactly as transformers does: with
        # exact score ties (few indexer heads, relu zeros) its tie order depends on the row count,
        # so chunked and one-shot prefill may pick different tied rows, in transformers as here.
        top = scores.topk(min(self.topk, t), dim=-1).indices  # (S, k)
        chosen = torch.zeros(scores.shape, dtype=torch.bool, device=rows.device).scatter_(1, top, True)
        return torch.zeros(scores.shape, dtype=rows.dtype, device=rows.device).masked_fill(~(chosen & ~future), float("-inf"))


class Attention(nn.Module):
    """One layer's attention (sliding, CSA or HCA), parameter names as in transformers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
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
        """``x (N, H)`` normalised block input → ``(N, H)``; updates each sequence's state."""
        n = x.shape[0]
        cos, sin = rope
        q_res = self.q_a_norm(self.q_a_proj(x))  # (N, qr)
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(n, self.n_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)  # (N, nh, D)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # (N, D)

        comp_kv = comp_gate = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.kv_proj(x), self.compressor.gate_proj(x)
        idx = self.indexer
        if idx is not None:
            idx_kv, idx_gate = idx.kv_proj(x), idx.gate_proj(x)
            idx_q = apply_rope(idx.q_b_proj(q_res).view(n, idx.n_heads, idx.width), cos, sin)
            idx_w = idx.scorer.weights_proj(x)  # (N, Hi)

        out = torch.empty_like(q)
        for s in seqs:
            a, b, st = s.start, s.end, s.state
            pos = positions[a:b]
            keys = torch.cat([st.swa, kv[a:b]])  # (n_w + S, D)
            key_pos = torch.arange(s.first_pos - st.swa.shape[0], s.first_pos + (b - a), device=x.device)
            st.swa = keys[-(self.window - 1) :] if self.window > 1 else keys[:0]
            rows = row_bias = None
            if self.compressor is not None:
                self.compressor.update(st.comp, comp_kv[a:b], comp_gate[a:b], rotary)
                rows = st.comp.rows
                if idx is not None:
                    idx.update(st.index, idx_kv[a:b], idx_gate[a:b], rotary)
                    if rows.shape[0]:
                        row_bias = idx.select(idx_q[a:b], idx_w[a:b], st.index.rows, pos)
                else:
                    visible = torch.arange(rows.shape[0], device=x.device)[None, :] < ((pos + 1) // self.compressor.rate)[:, None]
                    row_bias = torch.zeros(visible.shape, dtype=q.dtype, device=x.device).masked_fill(~visible, float("-inf"))
            out[a:b] = self._attend(q[a:b], pos, keys, key_pos, rows, row_bias)
        out = apply_rope(out, cos, -sin)  # undo the rotation values picked up as keys
        grouped = self.o_a_proj(out.reshape(n, self.o_groups, -1)).flatten(1)  # (N, G*o_lora)
        return self.o_b_proj(grouped)

    def _attend(
        self,
        q: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor,
        key_pos: torch.Tensor,
        rows: torch.Tensor | None,
        row_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Softmax attention with sinks for one sequence, tiled over queries. → ``(S, nh, D)``."""
        out = torch.empty_like(q)
        for t0 in range(0, q.shape[0], QUERY_TILE):
            t1 = min(t0 + QUERY_TILE, q.shape[0])
            p = pos[t0:t1]
            lo = int(torch.searchsorted(key_pos, p[0] - self.window + 1))
            hi = int(torch.searchsorted(key_pos, p[-1], right=True))
            k = keys[lo:hi]
            kp = key_pos[lo:hi]
            delta = p[:, None] - kp[None, :]
            bias = torch.zeros(delta.shape, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill((delta < 0) | (delta >= self.window), float("-inf"))  # (s, k)
            if rows is not None and rows.shape[0]:
                k = torch.cat([k, rows])
                bias = torch.cat([bias, row_bias[t0:t1]], dim=1)
            qt = q[t0:t1].transpose(0, 1)  # (nh, s, D)
            logits = torch.matmul(qt, k.t()) * self.scaling + bias  # (nh, s, K)
            sinks = self.sinks.view(-1, 1, 1).expand(-1, qt.shape[1], 1)  # fp32, promotes the logits
            combined = torch.cat([logits.to(torch.promote_types(logits.dtype, sinks.dtype)), sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1].to(k.dtype)
            out[t0:t1] = torch.matmul(probs, k).transpose(0, 1)
        return out
