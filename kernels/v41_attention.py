"""DeepSeek-V4.1 decode attention over stored FP8/FP4 codes, dequantised in the kernel.

One query token per batch row ``b`` with ``H`` heads attends over one shared key=value head:

- its window ring ``win_q[slot_b, :win_len[b]]`` (e4m3 codes, ue8m0 exponent per 32 channels;
  order inside the ring does not matter, softmax is permutation invariant), and
- the compressed rows the indexer chose, ``picks[b]`` (``-1``: none) into its slot's rows
  ``rows_q[slot_b]`` (packed e2m1 codes, e4m3 scale per 16 channels).

Softmax over ``[logits · scale, sink_h]`` with the sink column dropped; the output ``(B, H, D)``
fp32 still carries the keys' RoPE (the caller un-rotates it). Layout (``kernels.v41_kv``)::

    q        (B, H, D)        fp32 / bf16
    win_q    (S, W, D)        float8_e4m3fn      win_e  (S, W, D/32)    uint8
    rows_q   (S, T, D/2)      uint8              rows_s (S, T, D/16)    float8_e4m3fn
    slot, win_len (B,) int    picks (B, K) int   sinks (H,) fp32

The Triton kernel: grid ``(B, cdiv(H, BH), S)``, each program holds ``BH`` heads' queries and walks
its share of the key tiles (``BN`` rows each: the window's tiles, then the picks') with an online
softmax in fp32 (the products' operands in ``q``'s dtype: bf16 tensor-core dots for a bf16
model, exact fp32 ones for fp32); codes become values in registers (e4m3 through a cast, e2m1 from its three bits,
ue8m0 by placing the exponent). ``S`` splits of the key range (flash-decoding) where ``B ·
cdiv(H, BH)`` programs would leave the GPU mostly idle (batch 1: 4 programs on 132 SMs): each split
writes its running max, sum and unnormalised output, and a combine kernel (one program per
``(b, h)``) rescales them to a common max, adds the sink to the denominator and divides. One split
(large batches) is the single pass, which applies the sink itself. ``attention_splits`` picks
``S`` from the batch (``V41AttentionTuning``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import HAS_TRITON, dot_precision, next_pow2, num_sms, use_triton
from kernels.v41_kv import unpack_fp4_rows, unpack_fp8_window

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kernels._common import mma

    @triton.jit
    def _e2m1(nib):
        """Values of 4-bit e2m1 codes (int32): sign bit 3, exponent bits 1-2, mantissa bit 0."""
        e = (nib >> 1) & 3
        m = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, tl.where(e == 1, 1.0 + m * 0.5, tl.where(e == 2, 2.0 + m, 4.0 + 2.0 * m)))
        return tl.where((nib & 8) != 0, -mag, mag)

    @triton.jit
    def _online_step(q, k, ok, scale, m_i, l_i, acc, PRECISION: tl.constexpr):
        """One online-softmax block: scores of ``q (BH, D)`` against the dequantised keys
        ``k (BN, D)`` (rows where ``ok``), folded into the running max, sum and output. The keys
        in ``q``'s dtype (exact: FP8/FP4 values fit bf16) and the probabilities rounded to it for
        the value product, as the model's ``probs.to(keys.dtype)``; fp32 accumulation."""
        k = k.to(q.dtype)
        s = mma(q, tl.trans(k), PRECISION) * scale  # (BH, BN)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no row yet (a split's first tiles): no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + mma(p.to(q.dtype), k, PRECISION)

    @triton.jit
    def _v41_decode_kernel(
        q_ptr, wq_ptr, we_ptr, rq_ptr, rs_ptr, slot_ptr, wlen_ptr, pick_ptr, sink_ptr, out_ptr, ml_ptr,
        H, W, T, K, NW, NK, TPS, scale,
        s_qb, s_qh, s_wqs, s_wqn, s_wes, s_wen, s_rqs, s_rqn, s_rss, s_rsn, s_pb, s_ob, s_oh,
        D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, HAS_ROWS: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h0 = tl.program_id(1) * BH
        split = tl.program_id(2)
        heads = h0 + tl.arange(0, BH)
        dims = tl.arange(0, D)
        hmask = heads < H
        q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dims[None, :], mask=hmask[:, None], other=0.0)  # (BH, D) in its dtype
        slot = tl.load(slot_ptr + b)
        wlen = tl.load(wlen_ptr + b)
        m_i = tl.full((BH,), float("-inf"), tl.float32)
        l_i = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, D), tl.float32)
        t0 = split * TPS  # this split's key tiles [t0, t0 + TPS): the NW window tiles, then the NK picks'
        t1 = t0 + TPS
        for n0 in range(tl.minimum(t0, NW) * BN, tl.minimum(t1, NW) * BN, BN):  # the window ring
            rows = n0 + tl.arange(0, BN)
            ok = rows < wlen
            codes = tl.load(wq_ptr + slot * s_wqs + rows[:, None] * s_wqn + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            ex = tl.load(we_ptr + slot * s_wes + rows[:, None] * s_wen + dims[None, :] // 32, mask=ok[:, None], other=127).to(tl.int32)
            k = codes * (ex << 23).to(tl.float32, bitcast=True)  # (BN, D): 2^(e-127) from its bits
            m_i, l_i, acc = _online_step(q, k, ok, scale, m_i, l_i, acc, PRECISION)
        if HAS_ROWS:
            for n0 in range(tl.maximum(t0 - NW, 0) * BN, tl.maximum(tl.minimum(t1 - NW, NK), 0) * BN, BN):  # the indexer's picks
                j = n0 + tl.arange(0, BN)
                pick = tl.load(pick_ptr + b * s_pb + j, mask=j < K, other=-1)
                ok = pick >= 0
                row = tl.where(ok, pick, 0)
                byte = tl.load(rq_ptr + slot * s_rqs + row[:, None] * s_rqn + dims[None, :] // 2, mask=ok[:, None], other=0).to(tl.int32)
                nib = (byte >> ((dims[None, :] % 2) * 4)) & 15
                sc = tl.load(rs_ptr + slot * s_rss + row[:, None] * s_rsn + dims[None, :] // 16, mask=ok[:, None], other=0.0).to(tl.float32)
                k = _e2m1(nib) * sc  # (BN, D)
                m_i, l_i, acc = _online_step(q, k, ok, scale, m_i, l_i, acc, PRECISION)
        if SPLIT:  # partials: out (B, S, H, D) unnormalised, ml (B, S, 2, H) max and sum
            n_split = tl.num_programs(2)
            part = (b * n_split + split).to(tl.int64)
            tl.store(out_ptr + part * H * D + heads[:, None] * D + dims[None, :], acc, mask=hmask[:, None])
            tl.store(ml_ptr + (part * 2) * H + heads, m_i, mask=hmask)
            tl.store(ml_ptr + (part * 2 + 1) * H + heads, l_i, mask=hmask)
        else:
            sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
            m_fin = tl.maximum(m_i, sink)
            denom = l_i * tl.exp(m_i - m_fin) + tl.exp(sink - m_fin)  # the sink only in the denominator
            out = acc * (tl.exp(m_i - m_fin) / denom)[:, None]
            tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])

    @triton.jit
    def _v41_combine_kernel(part_ptr, ml_ptr, sink_ptr, out_ptr, H, S, s_ob, s_oh, D: tl.constexpr):
        """Program ``(b, h)``: the ``S`` splits' partials rescaled to their common max (the sink
        included), summed in fp32 and divided by the sum plus the sink's term."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        dims = tl.arange(0, D)
        sink = tl.load(sink_ptr + h)
        m_fin = sink
        for s in range(S):
            m_fin = tl.maximum(m_fin, tl.load(ml_ptr + ((b * S + s) * 2) * H + h))
        denom = tl.exp(sink - m_fin)  # the sink only in the denominator
        acc = tl.zeros((D,), tl.float32)
        for s in range(S):
            part = (b * S + s).to(tl.int64)
            alpha = tl.exp(tl.load(ml_ptr + (part * 2) * H + h) - m_fin)
            denom += tl.load(ml_ptr + (part * 2 + 1) * H + h) * alpha
            acc += tl.load(part_ptr + (part * H + h) * D + dims) * alpha
        tl.store(out_ptr + b * s_ob + h * s_oh + dims, (acc / denom).to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class V41AttentionTuning:
    """The decode attention's launch: ``block_h`` heads and ``block_n`` key rows a tile,
    ``num_warps``; the key range is split when the ``B · cdiv(H, block_h)`` programs of a single
    pass fill fewer than ``fill`` × the GPU's SMs: into enough splits to reach it, at most
    ``max_splits`` and at most one per key tile (``attention_splits``)."""

    block_h: int = 16
    block_n: int = 16
    num_warps: int = 4
    fill: float = 1.0
    max_splits: int = 32


V41_ATTENTION = V41AttentionTuning()  # the default


def attention_splits(programs: int, tiles: int, sms: int, tuning: V41AttentionTuning = V41_ATTENTION) -> int:
    """Splits of the key range for ``programs`` single-pass programs over ``tiles`` key tiles on
    ``sms`` SMs: 1 when they fill ``tuning.fill`` × the SMs, else ``cdiv(target, programs)``,
    capped by ``tuning.max_splits`` and ``tiles``."""
    target = int(tuning.fill * sms)
    if programs >= target:
        return 1
    return max(1, min(tuning.max_splits, tiles, -(-target // programs)))


def v41_decode_attention_reference(
    q: torch.Tensor, win_q: torch.Tensor, win_e: torch.Tensor, win_len: torch.Tensor, slot: torch.Tensor,
    rows_q: torch.Tensor | None, rows_s: torch.Tensor | None, picks: torch.Tensor | None, sinks: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The module's attention in PyTorch (dequantise, then one masked softmax with the sinks)."""
    b, w = q.shape[0], win_q.shape[1]
    keys = unpack_fp8_window(win_q[slot], win_e[slot])  # (B, W, D)
    mask = torch.zeros(b, w, device=q.device).masked_fill(torch.arange(w, device=q.device)[None] >= win_len[:, None], float("-inf"))
    if rows_q is not None:
        ok = picks >= 0  # (B, K)
        at = picks.clamp_min(0)
        rq = rows_q[slot[:, None], at]  # (B, K, D/2)
        rs = rows_s[slot[:, None], at]
        keys = torch.cat([keys, unpack_fp4_rows(rq, rs)], dim=1)  # (B, W+K, D)
        mask = torch.cat([mask, torch.zeros_like(ok, dtype=torch.float32).masked_fill(~ok, float("-inf"))], dim=1)
    logits = torch.matmul(q.float(), keys.transpose(1, 2)) * scale + mask[:, None, :]  # (B, H, L)
    logits = torch.cat([logits, sinks.float()[None, :, None].expand(b, -1, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, keys)  # (B, H, D)


def v41_decode_attention(
    q: torch.Tensor, win_q: torch.Tensor, win_e: torch.Tensor, win_len: torch.Tensor, slot: torch.Tensor,
    rows_q: torch.Tensor | None, rows_s: torch.Tensor | None, picks: torch.Tensor | None, sinks: torch.Tensor, scale: float,
    out_dtype: torch.dtype = torch.float32, tuning: V41AttentionTuning = V41_ATTENTION,
) -> torch.Tensor:  # fmt: skip
    """Decode attention over stored codes → ``(B, H, D)`` in ``out_dtype`` (fp32 softmax and sums, one cast at
    the end; module docstring): the Triton kernel where it runs, else
    ``v41_decode_attention_reference``."""
    if not use_triton(q):
        return v41_decode_attention_reference(q, win_q, win_e, win_len, slot, rows_q, rows_s, picks, sinks, scale).to(out_dtype)
    b, h, d = q.shape
    assert d == next_pow2(d) and d % 32 == 0, "head_dim must be a power of two, a multiple of 32"
    out = torch.empty(b, h, d, dtype=out_dtype, device=q.device)
    has_rows = rows_q is not None
    rq = rows_q if has_rows else win_q.view(torch.uint8)
    rs = rows_s if has_rows else win_q
    pk = picks if has_rows else slot[:, None]
    bh, bn = max(16, min(tuning.block_h, next_pow2(h))), tuning.block_n
    nw, nk = triton.cdiv(win_q.shape[1], bn), triton.cdiv(pk.shape[1], bn) if has_rows else 0
    splits = attention_splits(b * triton.cdiv(h, bh), nw + nk, num_sms(q.device), tuning)
    tps = triton.cdiv(nw + nk, splits)  # tiles per split
    splits = triton.cdiv(nw + nk, tps)  # none left empty
    if splits > 1:
        part = torch.empty(b, splits, h, d, dtype=torch.float32, device=q.device)  # unnormalised outputs
        ml = torch.empty(b, splits, 2, h, dtype=torch.float32, device=q.device)  # running max, sum
    else:
        part, ml = out, sinks
    _v41_decode_kernel[(b, triton.cdiv(h, bh), splits)](
        q, win_q, win_e, rq, rs, slot, win_len, pk, sinks, part, ml,
        h, win_q.shape[1], rq.shape[1], pk.shape[1], nw, nk, tps, float(scale),
        q.stride(0), q.stride(1), win_q.stride(0), win_q.stride(1), win_e.stride(0), win_e.stride(1),
        rq.stride(0), rq.stride(1), rs.stride(0), rs.stride(1), pk.stride(0), out.stride(0), out.stride(1),
        D=d, BH=bh, BN=bn, HAS_ROWS=has_rows, SPLIT=splits > 1, PRECISION=dot_precision(q.dtype), num_warps=tuning.num_warps,
    )  # fmt: skip
    if splits > 1:
        _v41_combine_kernel[(b, h)](part, ml, sinks, out, h, splits, out.stride(0), out.stride(1), D=d, num_warps=4)
    return out
