"""DeepSeek-V4.1 attention: shared-KV MQA over a sliding window plus a group's shared compressed KV.

Every layer attends over its last ``W`` tokens: one key=value head (``kv_norm(wkv(x))``, rotated,
FP8-rounded), per-head sinks that only enlarge the softmax denominator. A layer with
``compress_ratio > 0`` also attends over the compressed rows of its group, which only the
group's KV-source layer computes (``Compressor``: ``r`` tokens pooled by a softmax gate, or one
row per token at ratio 1; rotated at the group's first position, FP4-rounded, or MXFP8 with ``use_fp4_sparse_kv`` false) — CSA2 "reuse".
Which rows a query sees is chosen by the last index source (``Indexer``): the top
``index_topk`` complete rows by ``Σ_h w_h · relu(q_h · k)`` over FP4 queries and keys, inside
the candidate blocks of the candidate source when one ran earlier in the stack.

What one forward publishes from layer to layer (rows, keys, each query's chosen rows, the
candidate blocks) lives in a per-sequence ``Shared``; what persists across forwards lives in the
sequence's ``V41SequenceState``. Projections run on all tokens of a batch at once, the rest per
sequence. Attention is one masked softmax over [window ring, new keys, compressed rows] with the
reference's tensor shapes, so its roundings (and hence every FP8/FP4 rounding downstream) are
the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import GroupedLinear
from engine.model.rope import Rotary
from engine.model.v41.config import V41Config
from engine.model.v41 import prefill as fast_path
from engine.model.v41.layers import RMSNorm, linear_fp32
from engine.model.v41.prefill import use_fast
from engine.model.v41.quant import fp4_compressed, fp4_indexer, fp8_window
from engine.model.v41.state import SourceState, V41SequenceState
from kernels._common import use_triton
from kernels.moe_grouped import GemmConfig
from kernels.prefill import AttentionTuning
from kernels.reference import apply_rope_eager as apply_rope
from kernels.rope import rope_inplace
from kernels.topk import row_topk
from kernels.v41_pack import fp4_indexer_quant


@dataclass(frozen=True)
class V41Tuning:
    """The V4.1 model's settings, given where it is built (``load_v41_model``) and passed down to
    each layer. ``query_tile``: queries per attention / indexer tile of the general path, bounds
    the ``(nh, tile, L)`` logits of long prefills. ``fast``: take ``engine.model.v41.prefill``'s
    kernels (True), the general path (False), or the kernels on CUDA only (None).
    ``fast_index_tile``: queries per indexer tile of the fast path (``(tile, T)`` fp32 scores).
    ``expert_gemm``: the fast path's routed-expert GEMMs in bf16, ``(gate|up, down)``, each a
    ``kernels.moe_grouped.GemmConfig`` ``(BM, BN, BK, num_warps, num_stages)`` for its Triton
    grouped GEMM (gate|up: BN gate columns, the tile BM × 2·BN, the weighted SwiGLU in its
    epilogue) or None for ``torch._grouped_mm`` (+ ``kernels.v41_moe.weighted_swiglu``); None
    for both: by device (``prefill.expert_gemms``: the H200 sweep's configs on Hopper,
    ``python -m kernels.moe_grouped --shapes v41``); fp32 always keeps the torch path.
    ``attention``: the fast path's attention launch (``kernels.prefill.AttentionTuning``; None:
    ``prefill_attention``'s choice)."""

    query_tile: int = 256
    fast: bool | None = None
    fast_index_tile: int = 4096
    expert_gemm: tuple[GemmConfig | None, GemmConfig | None] | None = None
    attention: AttentionTuning | None = None


V41_TUNING = V41Tuning()  # the default


@dataclass
class Shared:
    """What the layers of one forward hand on for one sequence (see the module docstring)."""

    rows: torch.Tensor | None = None  # (T, D) the group's compressed KV
    keys: torch.Tensor | None = None  # (T, Di) the group's indexer keys
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (S, k) chosen rows, (S, k) True = valid
    candidates: torch.Tensor | None = None  # (S, T) True inside the candidate blocks


@dataclass
class Chunk:
    """One sequence's new tokens inside the flattened batch: rows ``[start, end)``, the first at
    position ``first_pos``."""

    state: V41SequenceState
    start: int
    end: int
    shared: Shared
    first_pos: int


class Compressor(nn.Module):
    """A KV-source layer's compressor: pre-RoPE latents of the groups the new tokens complete."""

    def __init__(self, cfg: V41Config, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False, dtype=dtype)
        self.wgate = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False, dtype=dtype) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def update(self, src: SourceState, x: torch.Tensor, start: int) -> tuple[torch.Tensor | None, int]:
        """``x (S, H)``, the tokens from position ``start`` → the latents ``(G, D)`` of the groups
        completed now (None: none) and the absolute position of the first one's first token;
        keeps the unfinished group in ``src``. Tokens the source already holds rows for (a replay
        over rows restored from the KV store) are skipped."""
        r = self.ratio
        first = src.rows.shape[0] * r
        held = first + src.buf_kv.shape[0]  # tokens compressed or buffered so far
        assert held >= start, f"compressor holds {held} tokens, chunk starts at {start}"
        x = x[held - start :]
        if x.shape[0] == 0:
            return None, first
        if self.wgate is None:  # ratio 1: every token is its own row
            return self.norm(self.wkv(x)), first
        # pooling in fp32 whatever the model dtype, as trained
        kv = torch.cat([src.buf_kv, linear_fp32(x, self.wkv.weight)])  # (n, D)
        gate = torch.cat([src.buf_gate, linear_fp32(x, self.wgate.weight)])  # (n, D)
        usable = kv.shape[0] // r * r
        src.buf_kv, src.buf_gate = kv[usable:].clone(), gate[usable:].clone()
        if usable == 0:
            return None, first
        g = usable // r
        weights = gate[:usable].view(g, r, -1).softmax(dim=1)  # (G, r, D) over each group's tokens
        pooled = (kv[:usable].view(g, r, -1) * weights).sum(dim=1)  # (G, D)
        return self.norm(pooled.to(x.dtype)), first


class Indexer(nn.Module):
    """An index source's sparse indexer; the group's KV source also owns the key projection."""

    def __init__(self, cfg: V41Config, layer_idx: int, dtype: torch.dtype, tuning: V41Tuning = V41_TUNING) -> None:
        super().__init__()
        self.tuning = tuning
        self.query_tile = tuning.query_tile
        self.ratio = cfg.compress_ratios[layer_idx]
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.softmax_scale, self.heads_scaling = cfg.index_head_dim**-0.5, cfg.index_n_heads**-0.5
        self.is_candidate_source = layer_idx == cfg.candidate_source_layer_id
        self.uses_candidates = 0 <= cfg.candidate_source_layer_id < layer_idx
        self.block_topk, self.block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False, dtype=dtype)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False, dtype=dtype)
        if layer_idx in cfg.kv_source_layer_ids:
            self.wk = nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False, dtype=dtype)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)

    def keys(self, latents: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Indexer keys ``(G, Di)`` of pre-RoPE latents ``(G, D)``: projected, rotated, FP4."""
        return fp4_indexer(apply_rope(self.k_norm(self.wk(latents)), *rope))

    def select(
        self, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor], shared: Shared,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Each query's chosen rows: indices ``(S, k)`` into ``keys (T, Di)`` and ``(S, k)`` True
        where the choice is a complete row. Publishes the candidate blocks at the candidate source."""
        s, t = x.shape[0], keys.shape[0]
        fast = use_fast(self.tuning.fast, x)
        q = rope_inplace(self.wq_b(q_res).view(s, self.n_heads, self.head_dim), *rope)  # (S, Hi, Di)
        q = fp4_indexer_quant(q) if fast else fp4_indexer(q)  # the same values in one kernel
        weights = self.weights_proj(x).float() * self.heads_scaling  # (S, Hi)
        complete = torch.div(positions + 1, self.ratio, rounding_mode="floor")  # (S,) rows < this are complete
        picks, valid, cands = [], [], []
        tile = self.tuning.fast_index_tile if fast else self.query_tile
        for t0 in range(0, s, tile):
            r = slice(t0, t0 + tile)
            if fast:
                scores = fast_path.indexer_scores(q[r], weights[r], keys, complete[r], self.softmax_scale)  # (s, T)
            else:
                scores = torch.einsum("bshd,btd->bsht", q[r].float()[None], keys.float()[None])[0].relu_() * self.softmax_scale  # (s, Hi, T)
                scores = (scores * weights[r].unsqueeze(-1)).sum(dim=1)  # (s, T)
                scores = scores.masked_fill(torch.arange(t, device=keys.device)[None, :] >= complete[r, None], float("-inf"))
            if self.is_candidate_source:
                cands.append(candidate_blocks(scores, complete[r], self.block_topk, self.block_size))
            elif self.uses_candidates and shared.candidates is not None:
                scores = scores.masked_fill(~shared.candidates[r], float("-inf"))
            # torch.topk over every row so far, future ones at -inf, as the reference: exact ties
            # (relu zeros) are then broken the same way; where Triton runs the fast path, one
            # launch that breaks them as torch.topk on CUDA does (kernels.topk)
            if fast and use_triton(scores):
                values, indices = row_topk(scores, min(self.topk, t))
            else:
                values, indices = scores.topk(min(self.topk, t), dim=-1, sorted=False)
            picks.append(indices)
            valid.append(values > float("-inf"))
        if self.is_candidate_source:
            shared.candidates = torch.cat(cands)  # (S, T)
        return torch.cat(picks), torch.cat(valid)

def candidate_blocks(scores: torch.Tensor, complete: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k: ``(S, T)`` True inside each query's ``topk_blocks`` best
    blocks of ``block_size`` rows (a block scores its best row; the block holding the query's
    newest complete row is always kept; blocks without a reachable row never are)."""
    t = scores.shape[-1]
    padded = F.pad(scores, (0, -t % block_size), value=float("-inf"))
    blocks = padded.view(scores.shape[0], -1, block_size).amax(dim=-1)  # (S, nb)
    newest = torch.div(complete - 1, block_size, rounding_mode="floor")  # (S,) -1: no row yet
    blocks = blocks.masked_fill(torch.arange(blocks.shape[1], device=scores.device)[None, :] == newest[:, None], float("inf"))
    if topk_blocks >= blocks.shape[1]:  # every block is in the top-k: the kept ones are those with a reachable row
        keep = blocks > float("-inf")
    else:
        top = blocks.topk(topk_blocks, dim=-1, sorted=False)  # a set: its order is never read
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep[:, :, None].expand(-1, -1, block_size).flatten(1)[:, :t]  # (no host sync: a CUDA graph runs it)


def bias(extra: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None], s: int) -> torch.Tensor:
    """The general path's additive bias ``(S, T)`` over the rows of ``_compressed``'s answer:
    0 where chosen, -inf elsewhere."""
    rows, top = extra
    out = torch.full((s, rows.shape[0] + 1), float("-inf"), dtype=torch.float32, device=rows.device)  # (S, T+1)
    if top is not None:  # a pick that is not a complete row goes to the dropped last column
        idx, valid = top
        out.scatter_(-1, torch.where(valid, idx, rows.shape[0]), 0.0)
    return out[:, :-1]


class Attention(nn.Module):
    """One V4.1 layer's attention (native parameter names)."""

    def __init__(self, cfg: V41Config, layer_idx: int, dtype: torch.dtype, tuning: V41Tuning = V41_TUNING) -> None:
        super().__init__()
        self.tuning = tuning
        self.query_tile = tuning.query_tile
        self.layer_idx = layer_idx
        self.ratio = cfg.compress_ratios[layer_idx]
        self.rope_kind = "compress" if self.ratio else "main"
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.scaling = cfg.head_dim**-0.5
        self.o_groups = cfg.o_groups
        h, qr = cfg.hidden_size, cfg.q_lora_rank
        self.wq_a = nn.Linear(h, qr, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(qr, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(qr, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wkv = nn.Linear(h, self.head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dtype)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        is_source = layer_idx in cfg.kv_source_layer_ids
        self.compressor = Compressor(cfg, self.ratio, dtype) if is_source else None
        self.fp4_rows = cfg.use_fp4_sparse_kv  # else MXFP8: the window's format (DeepInfer's V41_FORMAT holds both)
        self.indexer = Indexer(cfg, layer_idx, dtype, tuning) if layer_idx in cfg.index_source_layer_ids else None

    def empty_source(self, dtype: torch.dtype, device: torch.device) -> SourceState | None:
        """A fresh ``SourceState`` for a KV-source layer (None for the others)."""
        if self.compressor is None:
            return None
        d = self.head_dim
        keys = torch.empty(0, self.indexer.head_dim, dtype=dtype, device=device) if self.indexer is not None else None
        buf = torch.empty(0, d, dtype=torch.float32, device=device)
        return SourceState(torch.empty(0, d, dtype=dtype, device=device), keys, buf, buf.clone())

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        compress_rotary: Rotary, chunks: list[Chunk],
    ) -> torch.Tensor:  # fmt: skip
        """``x (N, H)`` normalised block input → ``(N, H)``; updates each chunk's state."""
        n = x.shape[0]
        cos, sin = ropes[self.rope_kind]
        q_res = self.q_norm(self.wq_a(x))  # (N, qr)
        q = rope_inplace(self.wq_b(q_res).view(n, self.n_heads, self.head_dim), cos, sin)  # (N, nh, D), the projection's own tensor
        kv = fp8_window(rope_inplace(self.kv_norm(self.wkv(x)), cos, sin))  # (N, D)
        out = torch.empty_like(q) if len(chunks) > 1 else None  # one chunk: its result is the output
        fast = use_fast(self.tuning.fast, x)
        for c in chunks:
            rows = slice(c.start, c.end)
            extra = None
            if self.ratio:
                comp_rope = (ropes["compress"][0][rows], ropes["compress"][1][rows])
                extra = self._compressed(c, x[rows], q_res[rows], positions[rows], comp_rope, compress_rotary)
            if fast:  # the kernel also undoes the rotation the values picked up as keys
                part = self._attend_fast(c, q[rows], kv[rows], extra, (cos[rows], sin[rows]))
            else:
                part = self._attend(c, q[rows], kv[rows], positions[rows], None if extra is None else (extra[0], bias(extra, c.end - c.start)))
            if out is None:
                out = part
            else:
                out[rows] = part
        if not fast:
            out = rope_inplace(out, cos, -sin)  # undo the rotation the values picked up as keys
        grouped = out.view(n, self.o_groups, -1)
        grouped = self.wo_a.rows(grouped) if fast and x.is_cuda else self.wo_a(grouped)  # (N, G, o_lora); rows: no flatten copy
        return self.wo_b(grouped.flatten(1))

    def _compressed(
        self, c: Chunk, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
        comp_rope: tuple[torch.Tensor, torch.Tensor], rotary: Rotary,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:  # fmt: skip
        """The group's compressed rows ``(T, D)`` and each query's picks among them (indices
        ``(S, k)``, True where valid; None: no row visible), None without rows. A KV source first
        extends and publishes its group's rows and keys."""
        sh = c.shared
        if self.compressor is not None:
            src = c.state.sources[self.layer_idx]
            latents, first = self.compressor.update(src, x, c.first_pos)
            if latents is not None:
                pos = first + self.ratio * torch.arange(latents.shape[0], device=x.device)
                rope = rotary.cos_sin(pos, latents.dtype)  # (G, rd/2) each
                if src.keys is not None:  # the source is also an index source: it owns the keys
                    src.keys = torch.cat([src.keys, self.indexer.keys(latents, rope)])  # (T, Di)
                rounding = fp4_compressed if self.fp4_rows else fp8_window
                src.rows = torch.cat([src.rows, rounding(apply_rope(latents, *rope))])  # (T, D)
            # a new group: what the previous group's index sources chose does not apply to it
            c.shared = sh = Shared(rows=src.rows, keys=src.keys)
        if self.indexer is not None:
            sh.top = None
            if sh.keys is not None and sh.keys.shape[0]:
                sh.top = self.indexer.select(x, q_res, sh.keys, positions, comp_rope, sh)
        if sh.rows is None or not sh.rows.shape[0]:
            return None
        return sh.rows, sh.top

    def _attend_fast(
        self, c: Chunk, q: torch.Tensor, kv: torch.Tensor, extra: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        """``_attend`` through ``engine.model.v41.prefill.window_attention`` (no mask tensor), the
        output un-rotated by ``rope`` (the chunk's ``(cos, sin)``) as ``forward`` does after ``_attend``."""
        ring = c.state.windows[self.layer_idx]
        out = fast_path.window_attention(q, ring, kv, self.window, self.attn_sink, self.scaling, *(extra or (None, None)), rope, self.tuning.attention)
        keys = torch.cat([ring, kv])  # (R+S, D)
        c.state.windows[self.layer_idx] = keys[max(0, keys.shape[0] - (self.window - 1)) :].clone()
        return out

    def _attend(
        self, c: Chunk, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        """``q (S, nh, D)`` over [ring, new keys ``kv (S, D)``, compressed rows] → ``(S, nh, D)``,
        ``query_tile`` queries at a time; keeps the last ``W-1`` window keys as the layer's ring."""
        st = c.state
        ring = st.windows[self.layer_idx]
        keys = torch.cat([ring, kv])  # (R+S, D): positions first-R .. last
        st.windows[self.layer_idx] = keys[max(0, keys.shape[0] - (self.window - 1)) :].clone()
        key_pos = torch.arange(keys.shape[0], device=kv.device) + (positions[0] - ring.shape[0])  # (R+S,)
        if extra is not None:
            keys = torch.cat([keys, extra[0]])  # (R+S+T, D)
        out = torch.empty_like(q)
        for t0 in range(0, q.shape[0], self.query_tile):
            t = slice(t0, t0 + self.query_tile)
            pos = positions[t, None]
            hidden = (key_pos[None, :] > pos) | (key_pos[None, :] <= pos - self.window)  # (s, R+S)
            mask = torch.zeros(hidden.shape, dtype=torch.float32, device=kv.device).masked_fill(hidden, float("-inf"))
            if extra is not None:
                mask = torch.cat([mask, extra[1][t]], dim=-1)  # (s, R+S+T)
            out[t] = self._softmax_attend(q[t], keys, mask)
        return out

    def _softmax_attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One masked softmax with the sinks: ``q (s, nh, D)``, ``keys (L, D)`` (= values), ``mask
        (s, L)`` additive → ``(s, nh, D)``, in the reference's ``(1, nh, s, L)`` layout."""
        qh = q.transpose(0, 1)[None]  # (1, nh, s, D)
        kh = keys[None, None]  # (1, 1, L, D): one key=value head for all query heads
        logits = torch.matmul(qh, kh.transpose(2, 3)) * self.scaling + mask  # (1, nh, s, L)
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(1, -1, q.shape[0], 1)
        logits = torch.cat([logits, sinks.float()], dim=-1)  # the sink: one more logit per row
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kh.dtype)  # sink only in the denominator
        return torch.matmul(probs, kh)[0].transpose(0, 1)  # (s, nh, D)
