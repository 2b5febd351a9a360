"""The lightning indexer of DeepSeek-V4's CSA layers at decode: fused scoring, then top-k.

For each sequence ``b`` (one query) and each of its compressed indexer rows ``t``::

    score[b, t] = scale · Σ_h w[b, h] · relu(q[b, h] · k[b, t])      (t < row_len[b], else -inf)

with ``scale = index_head_dim**-0.5 · index_n_heads**-0.5`` in the model (``softmax_scale ·
weights_scaling``). ``row_len[b]`` is the count of complete rows, ``(pos + 1) // rate``: the
causal mask. Rows live in one pool per layer like the attention's compressed rows::

    q        (B, Hi, Di)    rotated indexer queries
    weights  (B, Hi)        per-head weights (``weights_proj(x)``)
    rows     (R, Di)        indexer-row pool; sequence b owns rows[row_start[b] : row_start[b] + row_len[b]]
    → scores (B, T) fp32, T = max row_len (or ``t_max``), -inf past each row_len

The Triton kernel: grid ``(B, T / BT)``; a program loads all ``Hi`` query heads once and one tile
of ``BT`` rows, one ``(Hi, Di) × (Di, BT)`` dot, relu, weighted head sum — the ``(B, Hi, T)``
logits never reach memory. ``indexer_topk`` adds ``torch.topk`` and marks missing rows ``-1``,
which is the ``row_idx`` that ``kernels.decode_attention`` takes.
"""

from __future__ import annotations

import torch

from kernels._common import (
    HAS_TRITON,
    dot_precision,
    mma,
    next_pow2,
    tl,
    triton,
    use_triton,
)


def indexer_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    row_start: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    t_max: int | None = None,
) -> torch.Tensor:
    """Per-sequence loop with ``Indexer.scores``' scoring in fp32. → ``(B, T)`` fp32."""
    b_size = q.shape[0]
    t = int(row_len.max()) if t_max is None else t_max
    out = torch.full((b_size, t), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(b_size):
        a, n = int(row_start[b]), int(row_len[b])
        logits = torch.matmul(q[b].float(), rows[a : a + n].t().float())  # (Hi, n)
        out[b, :n] = (torch.relu(logits) * weights[b].float()[:, None]).sum(dim=0) * scale
    return out


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    row_start: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    t_max: int | None = None,
    *,
    block_t: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Fused indexer scores (layout in the module docstring). → ``(B, T)`` fp32.

    ``t_max`` (≥ every row_len) avoids the host sync on ``row_len.max()``.
    """
    if not use_triton(q):
        return indexer_scores_reference(q, weights, rows, row_start, row_len, scale, t_max)
    b_size, hi, di = q.shape
    assert rows.shape[1] == di and q.stride(-1) == 1 and rows.stride(-1) == 1
    t = int(row_len.max()) if t_max is None else t_max
    out = torch.empty(b_size, t, dtype=torch.float32, device=q.device)
    if b_size == 0 or t == 0:
        return out
    _indexer_kernel[(b_size, triton.cdiv(t, block_t))](
        q, weights, rows, row_start, row_len, out,
        hi, di, t, q.stride(0), q.stride(1), weights.stride(0), rows.stride(0), scale,
        HI_PAD=max(16, next_pow2(hi)), DI_PAD=max(16, next_pow2(di)), BT=block_t,
        PRECISION=dot_precision(q.dtype), num_warps=num_warps,
    )  # fmt: skip
    return out


def indexer_scores_prefill(
    q: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    t_max: int,
    *,
    block_q: int = 2,
    block_t: int = 64,
    num_warps: int = 8,
) -> torch.Tensor:
    """``indexer_scores`` for the queries of one sequence's prefill chunk, which share one row
    pool (``row_start`` 0): a program takes ``block_q`` consecutive queries (``block_q · Hi`` rows
    of one dot, the row tiles read once for all of them), loops over the row tiles below its
    queries' largest ``row_len`` (causal rows only) and fills the rest with -inf. → ``(S, t_max)`` fp32."""
    if not use_triton(q):
        return indexer_scores_reference(q, weights, rows, torch.zeros_like(row_len), row_len, scale, t_max)
    s, hi, di = q.shape
    assert rows.shape[1] == di and q.stride(-1) == 1 and rows.stride(-1) == 1 and weights.stride(-1) == 1
    out = torch.empty(s, t_max, dtype=torch.float32, device=q.device)
    if s == 0 or t_max == 0:
        return out
    _indexer_prefill_kernel[(triton.cdiv(s, block_q),)](
        q, weights, rows, row_len, out,
        s, hi, di, t_max, q.stride(0), q.stride(1), weights.stride(0), rows.stride(0), scale,
        HI_PAD=max(16, next_pow2(hi)), DI_PAD=max(16, next_pow2(di)), BQ=block_q, BT=block_t,
        PRECISION=dot_precision(q.dtype), num_warps=num_warps,
    )  # fmt: skip
    return out


def mask_topk(scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """Top-``k`` column indices per row of ``scores (B, T)``, int32, ``-1`` where the score is -inf;
    by descending score, or in no particular order with ``ordered=False`` (the same set, no sort
    pass: the attention kernel reads the picks in any order)."""
    k = min(k, scores.shape[1])
    vals, idx = scores.topk(k, dim=-1, sorted=ordered)  # (B, k)
    return torch.where(vals == float("-inf"), -1, idx).to(torch.int32)


def indexer_topk_reference(q, weights, rows, row_start, row_len, k: int, scale: float, t_max: int | None = None) -> torch.Tensor:
    return mask_topk(indexer_scores_reference(q, weights, rows, row_start, row_len, scale, t_max), k)


def indexer_topk(q, weights, rows, row_start, row_len, k: int, scale: float, t_max: int | None = None) -> torch.Tensor:
    """Each sequence's top-``k`` rows, local indices ``(B, min(k, T))`` int32, ``-1`` = none."""
    return mask_topk(indexer_scores(q, weights, rows, row_start, row_len, scale, t_max), k)


if HAS_TRITON:

    @triton.jit
    def _indexer_kernel(
        q_ptr, w_ptr, rows_ptr, row_start_ptr, row_len_ptr, out_ptr,
        HI, DI, T, stride_qb, stride_qh, stride_wb, stride_r, scale,
        HI_PAD: tl.constexpr, DI_PAD: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        t0 = tl.program_id(1) * BT
        offs_h = tl.arange(0, HI_PAD)
        offs_d = tl.arange(0, DI_PAD)
        offs_t = t0 + tl.arange(0, BT)
        h_ok = offs_h < HI
        d_ok = offs_d < DI
        n = tl.load(row_len_ptr + b).to(tl.int32)
        start = tl.load(row_start_ptr + b).to(tl.int64)
        t_ok = offs_t < n
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=h_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (HI_PAD, DI_PAD)
        w = tl.load(w_ptr + b.to(tl.int64) * stride_wb + offs_h, mask=h_ok, other=0.0).to(tl.float32)  # (HI_PAD,)
        k = tl.load(
            rows_ptr + (start + offs_t.to(tl.int64))[:, None] * stride_r + offs_d[None, :],
            mask=t_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (BT, DI_PAD)
        s = mma(q, tl.trans(k), PRECISION)  # (HI_PAD, BT) fp32
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0) * scale  # (BT,)
        score = tl.where(t_ok, score, float("-inf"))
        tl.store(out_ptr + b.to(tl.int64) * T + offs_t, score, mask=offs_t < T)


    @triton.jit
    def _indexer_prefill_kernel(
        q_ptr, w_ptr, rows_ptr, row_len_ptr, out_ptr,
        S, HI, DI, T, stride_qb, stride_qh, stride_wb, stride_r, scale,
        HI_PAD: tl.constexpr, DI_PAD: tl.constexpr, BQ: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        q0 = tl.program_id(0) * BQ
        qi = q0 + tl.arange(0, BQ)  # (BQ,) this program's queries
        q_ok = qi < S
        m = tl.arange(0, BQ * HI_PAD)  # (query, head) pairs, query-major
        mq = q0 + m // HI_PAD
        mh = m % HI_PAD
        m_ok = (mq < S) & (mh < HI)
        offs_d = tl.arange(0, DI_PAD)
        d_ok = offs_d < DI
        q = tl.load(
            q_ptr + mq.to(tl.int64)[:, None] * stride_qb + mh[:, None] * stride_qh + offs_d[None, :],
            mask=m_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (BQ·HI_PAD, DI_PAD)
        w = tl.load(w_ptr + mq.to(tl.int64) * stride_wb + mh, mask=m_ok, other=0.0).to(tl.float32)
        n = tl.load(row_len_ptr + qi, mask=q_ok, other=0).to(tl.int32)  # (BQ,)
        n_max = tl.minimum(tl.max(n, axis=0), T)
        out_row = out_ptr + qi.to(tl.int64)[:, None] * T
        for t0 in range(0, n_max, BT):  # tiles holding some query's visible rows
            offs_t = t0 + tl.arange(0, BT)
            k = tl.load(
                rows_ptr + offs_t.to(tl.int64)[:, None] * stride_r + offs_d[None, :],
                mask=(offs_t < n_max)[:, None] & d_ok[None, :], other=0.0,
            )  # (BT, DI_PAD)
            logits = mma(q, tl.trans(k), PRECISION)  # (BQ·HI_PAD, BT) fp32
            heads = tl.reshape(tl.maximum(logits, 0.0) * w[:, None], (BQ, HI_PAD, BT))
            score = tl.sum(heads, axis=1) * scale  # (BQ, BT)
            score = tl.where(offs_t[None, :] < n[:, None], score, float("-inf"))
            tl.store(out_row + offs_t[None, :], score, mask=q_ok[:, None] & (offs_t < T)[None, :])
        blank = tl.full((BQ, BT), float("-inf"), tl.float32)
        for t0 in range(tl.cdiv(n_max, BT) * BT, T, BT):  # no visible row: -inf
            offs_t = t0 + tl.arange(0, BT)
            tl.store(out_row + offs_t[None, :], blank, mask=q_ok[:, None] & (offs_t < T)[None, :])


def indexer_cost(b: int, hi: int, di: int, rows_per_seq: float, elem: int = 2) -> tuple[float, float]:
    """Fewest bytes (q, weights, rows read; fp32 scores written) and FLOPs of one scoring call."""
    nbytes = elem * b * (hi * di + hi + rows_per_seq * di) + 4 * b * rows_per_seq
    flops = 2.0 * b * hi * di * rows_per_seq + 3.0 * b * hi * rows_per_seq
    return nbytes, flops
