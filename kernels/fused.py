"""Fused glue of the static decode step (``engine.model.static_decode``): one kernel where the
PyTorch ops of the general path launch 5-45 small ones.

At batch 1 the step's time was ~1,000 elementwise / copy / reduce launches of 1-2 µs each
(slice bench run 4, ``kernels/NOTES.md``); these kernels replace the largest groups, each with its PyTorch
reference (the general path's own ops) used off CUDA, so the CPU path is unchanged:

- ``hc_pre_parts``: the mHC input norm + ``F.linear(flat, fn)`` as split-K partial dot products
  and sums of squares (``kernels.mhc.hc_mix_parts`` adds the splits and applies the RMS scale);
- ``collapse_norm``: ``collapse(pre, streams)`` then the block's ``RMSNorm`` (one pass);
- ``hc_merge``: ``post ⊗ out + combᵀ @ streams`` (``layers.hc_merge``);
- ``norm_rope``: weighted RMSNorm / unweighted head norm / nothing, then partial interleaved RoPE
  from a per-position cos/sin table (``Rotary.cos_sin`` of every position, computed once);
- ``compress_step``: a compressor's tokens of a step (a verify's ``1 + k`` offsets in the same
  launch, in order): buffer writes, and for the tokens whose window closes the gated pooling
  (softmax over slots), ``kv_norm``, RoPE, the row and overlap writes;
- ``swiglu``: the clamped SwiGLU of the shared expert.

Roundings follow the general path (bf16 where it casts, fp32 math in between), so in fp32 the
results equal it to float rounding and in bf16 to the last bit in most elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton

if HAS_TRITON:
    from kernels._common import launch_dependents



@dataclass(frozen=True)
class NormRopeTuning:
    """``norm_rope``'s launch: ``rows`` rows of D per program for calls of at least ``min_rows``
    rows (prefill), one row per program below; the bench sweeps them (bench/gpu_prefill_trace.py
    --micro)."""

    rows: int = 8
    min_rows: int = 16384


NORM_ROPE = NormRopeTuning()  # the default

# ---- references (the general path's ops) -----------------------------------------------------


def collapse_norm_reference(pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from kernels.reference import collapse

    x = collapse(pre, streams)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def hc_merge_reference(post, comb, out, streams):
    """``layers.hc_merge``'s PyTorch ops (which, on CUDA, now call ``hc_merge`` here)."""
    dtype = streams.dtype
    mix = comb.to(dtype).transpose(-1, -2).contiguous()
    return torch.baddbmm(post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2), mix, streams)


def norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor | None, mode: int, eps: float,
    cos_tab: torch.Tensor | None, sin_tab: torch.Tensor | None, pos: torch.Tensor | None,
    pos_div: int = 1, sign: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """``x (N, G, D)``; mode 1: ``RMSNorm`` (fp32 ``weight``), 2: ``unweighted_rms_norm``, 0: none;
    then RoPE at ``(pos // pos_div) * pos_div`` from the tables (``sign=-1``: the inverse)."""
    from kernels.reference import apply_rope_eager, unweighted_rms_norm_eager

    if mode == 1:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        y = (weight * h).to(x.dtype)
    elif mode == 2:
        y = unweighted_rms_norm_eager(x, eps)
    else:
        y = x
    if cos_tab is None:
        return y.contiguous()
    p = torch.div(pos, pos_div, rounding_mode="floor") * pos_div
    cos, sin = cos_tab[p], sin_tab[p]
    return apply_rope_eager(y, cos, -sin if sign < 0 else sin)


def compress_step_reference(
    kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
    buf_kv: torch.Tensor, buf_gate: torch.Tensor, overlap_kv: torch.Tensor | None, overlap_gate: torch.Tensor | None,
    position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    cos_tab: torch.Tensor, sin_tab: torch.Tensor, rows: torch.Tensor, cols: int | None = None,
) -> None:  # fmt: skip
    """``compress_step`` with the general path's ops (``Compressor.update``'s pooling, ``kv_norm``,
    RoPE) in one pass over every column; reads which rows close on the host (not capturable).

    A closing window pools the buffer as it was before the step with this step's earlier
    columns of its slot laid over it (offsets ``0 .. j``: with ``width <= r`` all of them are in
    the window), so the later offsets' entries, written into the buffer with the rest, do not
    reach it: the result of taking the offsets one after another."""
    n = kv.shape[0]
    cols = n if cols is None else cols
    r, d = buf_kv.shape[1], rows.shape[2]
    j = pos % r
    close = (j == r - 1).nonzero().squeeze(1)  # at most one per slot (width <= r)
    if close.numel():
        s, window = slots[close], torch.div(pos[close], r, rounding_mode="floor")
        ckv, cgate = buf_kv[s], buf_gate[s]  # (m, r, P) copies of the buffers before the step
        member = close[:, None] - cols * torch.arange(n // cols, device=pos.device)  # offsets o .. 0 of the closing slot
        at, o = (member >= 0).nonzero(as_tuple=True)
        col = member[at, o]
        ckv[at, j[col]] = kv[col]
        cgate[at, j[col]] = gate[col].to(buf_gate.dtype)
        cgate = cgate + position_bias  # gates in fp32
        if overlap_kv is not None:  # the previous window's Ca (none before the first), then this one's Cb
            has_prev = (window >= 1)[:, None, None]
            prev_kv = torch.where(has_prev, overlap_kv[s], 0).to(ckv.dtype)
            prev_gate = torch.where(has_prev, overlap_gate[s], float("-inf"))
            pool_kv, pool_gate = torch.cat([prev_kv, ckv[..., d:]], dim=1), torch.cat([prev_gate, cgate[..., d:]], dim=1)
            overlap_kv[s], overlap_gate[s] = ckv[..., :d], cgate[..., :d].to(overlap_gate.dtype)
        else:
            pool_kv, pool_gate = ckv, cgate
        pooled = (pool_kv * pool_gate.softmax(dim=1, dtype=torch.float32).to(pool_kv.dtype)).sum(dim=1)  # (m, d)
        rows[s, window] = norm_rope_reference(pooled[:, None], norm_weight, 1, eps, cos_tab, sin_tab, window * r)[:, 0]
    buf_kv[slots, j] = kv
    buf_gate[slots, j] = gate.to(buf_gate.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


# ---- wrappers --------------------------------------------------------------------------------


def hc_pre_parts(streams: torch.Tensor, fn: torch.Tensor, *, block_k: int = 128, target_programs: int = 128, max_splits: int = 8) -> torch.Tensor:
    """``streams (N, hc, H)``, ``fn (M, hc·H)`` fp32 → partials ``(N, S, MP)`` fp32: per split of the
    ``hc·H`` axis, ``fn @ x`` in columns ``[:M]`` and ``Σ x²`` in column ``M`` (x = fp32 streams)."""
    n = streams.shape[0]
    x = streams.reshape(n, -1)
    assert x.stride(-1) == 1 and fn.is_contiguous() and fn.dtype == torch.float32
    k = x.shape[1]
    m = fn.shape[0]
    mp = next_pow2(m + 1)
    block_k = min(block_k, next_pow2(k))
    nblocks = triton.cdiv(k, block_k)
    # hc_mix_parts adds the splits serially per row: few splits (run 5: 128 splits at b=1 made
    # that kernel 34 µs instead of 9)
    splits = max(1, min(nblocks, max_splits, triton.cdiv(target_programs, max(n, 1))))
    per = triton.cdiv(nblocks, splits) * block_k
    splits = triton.cdiv(k, per)
    parts = torch.empty(n, splits, mp, dtype=torch.float32, device=streams.device)
    if n:
        _hc_pre_kernel[(n, splits)](
            x, fn, parts, k, m, x.stride(0), per, MP=mp, BK=block_k, num_warps=4,
        )  # fmt: skip
    return parts


def collapse_norm(pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(collapse(pre, streams))``: ``pre (N, hc)`` fp32, ``streams (N, hc, H)`` → ``(N, H)``."""
    if not use_triton(streams):
        return collapse_norm_reference(pre, streams, weight, eps)
    n, hc, h = streams.shape
    assert streams.is_contiguous()
    pre = pre.contiguous()
    out = torch.empty(n, h, dtype=streams.dtype, device=streams.device)
    if n:
        _collapse_norm_kernel[(n,)](pre, streams, weight, out, h, eps, HC=hc, BH=next_pow2(h), num_warps=8)
    return out


def hc_merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor, *, block_h: int = 1024) -> torch.Tensor:
    """New streams ``(N, hc, H)`` = ``post ⊗ out + combᵀ @ streams`` (as ``layers.hc_merge``)."""
    if not use_triton(streams):
        return hc_merge_reference(post, comb, out, streams)
    n, hc, h = streams.shape
    assert streams.is_contiguous() and out.is_contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    new = torch.empty_like(streams)
    block_h = min(block_h, next_pow2(h))
    if n:
        _hc_merge_kernel[(n, triton.cdiv(h, block_h))](post, comb, out, streams, new, h, HC=hc, BH=block_h, num_warps=4)
    return new


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, mode: int, eps: float,
    cos_tab: torch.Tensor | None = None, sin_tab: torch.Tensor | None = None, pos: torch.Tensor | None = None,
    pos_div: int = 1, sign: float = 1.0, *, out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
    tuning: NormRopeTuning = NORM_ROPE,
) -> torch.Tensor:  # fmt: skip
    """See ``norm_rope_reference``; ``x (N, G, D)`` with unit last stride → contiguous ``(N, G, D)``;
    or, with ``out (R, D)`` contiguous and ``out_rows (N·G,)`` int64, row ``i`` of the result is
    written to ``out[out_rows[i]]`` (a scatter into a pool, e.g. the window ring) and ``out`` returned."""
    if not use_triton(x):
        y = norm_rope_reference(x, weight, mode, eps, cos_tab, sin_tab, pos, pos_div, sign)
        return y if out_rows is None else out.index_copy_(0, out_rows, y.reshape(-1, y.shape[-1]))
    n, g, d = x.shape
    assert x.stride(-1) == 1
    if out_rows is None:
        out = torch.empty(n, g, d, dtype=x.dtype, device=x.device)
    else:
        assert out.is_contiguous() and out.shape[-1] == d and out.dtype == x.dtype and out_rows.numel() == n * g
    rope = 0 if cos_tab is None else 2 * cos_tab.shape[1]
    rows = n * g
    bd = next_pow2(d)
    # rows per program: one (x, 4 warps) for decode-size calls; for prefill-size calls (the q pass
    # at 8K is 512K rows of 512) 8 rows, so each thread moves 16-byte vectors and far fewer
    # programs are scheduled (run 9: one row per program ran at ~1.9 TB/s)
    br = tuning.rows if rows >= tuning.min_rows else 1
    br = max(1, min(br, 8192 // bd))
    if rows:
        _norm_rope_kernel[(triton.cdiv(rows, br),)](
            x, weight if weight is not None else x, pos if pos is not None else x,
            cos_tab if cos_tab is not None else x, sin_tab if sin_tab is not None else x, out,
            out_rows if out_rows is not None else x,
            rows, g, d, x.stride(0), x.stride(1), pos_div, float(sign), eps,
            MODE=mode, ROPE=rope, BD=bd, BR=br, DST=out_rows is not None, num_warps=4 if d * br <= 4096 else 8,
        )  # fmt: skip
    return out


def compress_step(
    kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
    buf_kv: torch.Tensor, buf_gate: torch.Tensor, overlap_kv: torch.Tensor | None, overlap_gate: torch.Tensor | None,
    position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    cos_tab: torch.Tensor, sin_tab: torch.Tensor, rows: torch.Tensor, cols: int | None = None,
) -> None:  # fmt: skip
    """A step's tokens through a compressor in one launch (off Triton: ``compress_step_reference``).
    ``kv, gate (n, P)`` the tokens' projections, ``pos, slots (n,)``, offset-major: ``cols``
    columns per offset (default ``n``: a plain step; a verify's ``1 + k`` offsets, at most ``r``,
    each slot's consecutive positions); pools as ``slots.pool.CompPool`` (``rows (S+1, Tc+1, d)``).
    Column by column in offset order (one program per ``cols`` column, its slot's offsets in
    turn): writes ``buf[slot, pos % r]``; where ``pos % r == r-1`` pools the window (CSA: the
    overlap's ``r`` slots, when there is a previous window, and this window's second half),
    normalises, rotates at ``(pos // r)·r`` and writes ``rows[slot, pos // r]`` and (CSA) the new
    overlap, before a later offset's token overwrites a buffer entry."""
    n = kv.shape[0]
    cols = n if cols is None else cols
    assert n == 0 or n % cols == 0, (n, cols)
    if not use_triton(kv):
        return compress_step_reference(
            kv, gate, pos, slots, buf_kv, buf_gate, overlap_kv, overlap_gate, position_bias, norm_weight, eps, cos_tab, sin_tab, rows, cols
        )  # fmt: skip
    p = kv.shape[1]
    r = buf_kv.shape[1]
    d = rows.shape[2]
    overlap = overlap_kv is not None
    assert kv.stride(-1) == 1 and gate.stride(-1) == 1 and buf_kv.is_contiguous() and rows.is_contiguous()
    if n:
        _compress_kernel[(cols,)](
            kv, gate, pos, slots, buf_kv, buf_gate,
            overlap_kv if overlap else buf_kv, overlap_gate if overlap else buf_gate,
            position_bias, norm_weight, cos_tab, sin_tab, rows,
            p, d, r, rows.shape[1], eps, kv.stride(0), gate.stride(0), cols, n // cols,
            OVERLAP=overlap, ROPE=2 * cos_tab.shape[1], BP=next_pow2(p), BD=next_pow2(d), num_warps=4,
        )  # fmt: skip


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if not use_triton(gate):
        return swiglu_reference(gate, up, limit)
    n, i = gate.shape
    out = torch.empty_like(gate)
    block = min(1024, next_pow2(i))
    if n:
        _swiglu2_kernel[(n, triton.cdiv(i, block))](
            gate, up, out, i, gate.stride(0), up.stride(0), float(limit), BLOCK=block, num_warps=4
        )
    return out


if HAS_TRITON:

    @triton.jit
    def _hc_pre_kernel(x_ptr, fn_ptr, part_ptr, K, M, stride_x, PER, MP: tl.constexpr, BK: tl.constexpr):
        n = tl.program_id(0)
        s = tl.program_id(1)
        splits = tl.num_programs(1)
        m = tl.arange(0, MP)
        m_ok = m < M
        acc = tl.zeros((MP, BK), tl.float32)
        sq = tl.zeros((BK,), tl.float32)
        k0 = s * PER
        for kk in range(0, PER, BK):
            k = k0 + kk + tl.arange(0, BK)
            k_ok = k < K
            x = tl.load(x_ptr + n.to(tl.int64) * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w * x[None, :]
            sq += x * x
        dots = tl.sum(acc, axis=1)
        res = tl.where(m == M, tl.sum(sq, axis=0), dots)
        tl.store(part_ptr + (n.to(tl.int64) * splits + s) * MP + m, res)

    @triton.jit
    def _collapse_norm_kernel(pre_ptr, x_ptr, w_ptr, out_ptr, H, eps, HC: tl.constexpr, BH: tl.constexpr):
        launch_dependents()  # a GEMV after this (kernels.gemv, pdl) streams its first weights meanwhile
        n = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        ok = h < H
        out_ty = out_ptr.dtype.element_ty
        acc = tl.zeros((BH,), tl.float32)
        for s in tl.static_range(HC):
            p = tl.load(pre_ptr + n * HC + s)
            acc += p * tl.load(x_ptr + (n * HC + s) * H + h, mask=ok, other=0.0).to(tl.float32)
        x = acc.to(out_ty).to(tl.float32)  # collapse returns the streams' dtype
        y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps))
        w = tl.load(w_ptr + h, mask=ok, other=0.0)
        tl.store(out_ptr + n * H + h, (w * y).to(out_ty), mask=ok)

    @triton.jit
    def _hc_merge_kernel(post_ptr, comb_ptr, o_ptr, s_ptr, new_ptr, H, HC: tl.constexpr, BH: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = h < H
        ty = new_ptr.dtype.element_ty
        o = tl.load(o_ptr + n * H + h, mask=ok, other=0.0).to(tl.float32)
        for i in tl.static_range(HC):
            p = tl.load(post_ptr + n * HC + i).to(ty).to(tl.float32)
            acc = (p * o).to(ty).to(tl.float32)  # post.to(dtype) * out, a product in the dtype
            for j in tl.static_range(HC):
                c = tl.load(comb_ptr + n * HC * HC + j * HC + i).to(ty).to(tl.float32)  # combᵀ[i, j]
                acc += c * tl.load(s_ptr + (n * HC + j) * H + h, mask=ok, other=0.0).to(tl.float32)
            tl.store(new_ptr + (n * HC + i) * H + h, acc.to(ty), mask=ok)

    @triton.jit
    def _rope_row(y, cos_ptr, sin_ptr, p, D, sign, ROPE: tl.constexpr, BD: tl.constexpr):
        """Rotate the trailing ``ROPE`` channels (interleaved pairs) of the fp32 row ``y (BD,)`` by
        table row ``p``; the rotated values are rounded to the table's dtype and back."""
        ty = cos_ptr.dtype.element_ty
        half = ROPE // 2
        ev, od = tl.split(tl.reshape(y, (BD // 2, 2)))
        i = tl.arange(0, BD // 2)
        first = D // 2 - half
        is_r = (i >= first) & (i < D // 2)
        j = tl.where(is_r, i - first, 0)
        c = tl.load(cos_ptr + p * half + j, mask=is_r, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + p * half + j, mask=is_r, other=0.0).to(tl.float32) * sign
        ne = tl.where(is_r, (ev * c - od * s).to(ty).to(tl.float32), ev)
        no = tl.where(is_r, (od * c + ev * s).to(ty).to(tl.float32), od)
        return tl.reshape(tl.join(ne, no), (BD,))

    @triton.jit
    def _rope_rows(y, cos_ptr, sin_ptr, p, D, sign, ROPE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
        """``_rope_row`` of ``BR`` rows ``y (BR, BD)``, row ``r`` by table row ``p[r]``."""
        ty = cos_ptr.dtype.element_ty
        half = ROPE // 2
        ev, od = tl.split(tl.reshape(y, (BR, BD // 2, 2)))
        i = tl.arange(0, BD // 2)[None, :]
        first = D // 2 - half
        is_r = (i >= first) & (i < D // 2)
        j = tl.where(is_r, i - first, 0)
        t = p[:, None] * half + j  # (BR, BD/2)
        c = tl.load(cos_ptr + t, mask=is_r, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t, mask=is_r, other=0.0).to(tl.float32) * sign
        ne = tl.where(is_r, (ev * c - od * s).to(ty).to(tl.float32), ev)
        no = tl.where(is_r, (od * c + ev * s).to(ty).to(tl.float32), od)
        return tl.reshape(tl.join(ne, no), (BR, BD))

    @triton.jit
    def _norm_rope_kernel(
        x_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, dst_ptr,
        ROWS, G, D, stride_xn, stride_xg, pos_div, sign, eps,
        MODE: tl.constexpr, ROPE: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, DST: tl.constexpr,
    ):  # fmt: skip
        launch_dependents()
        row = tl.program_id(0) * BR + tl.arange(0, BR)  # (BR,) rows of the flattened (N·G, D)
        r_ok = row < ROWS
        n = (row // G).to(tl.int64)
        g = row % G
        d = tl.arange(0, BD)
        ok = r_ok[:, None] & (d < D)[None, :]
        ty = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + (n * stride_xn + g * stride_xg)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
        if MODE == 1:
            h = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
            y = (tl.load(w_ptr + d, mask=d < D, other=0.0)[None, :] * h).to(ty).to(tl.float32)
        elif MODE == 2:
            rs = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)).to(ty).to(tl.float32)
            y = (x * rs[:, None]).to(ty).to(tl.float32)
        else:
            y = x
        if ROPE > 0:
            p = tl.load(pos_ptr + n, mask=r_ok, other=0)
            p = (p // pos_div) * pos_div
            y = _rope_rows(y, cos_ptr, sin_ptr, p, D, sign, ROPE, BR, BD)
        if DST:  # scattered into a pool's rows
            orow = tl.load(dst_ptr + row, mask=r_ok, other=0).to(tl.int64)
        else:
            orow = row.to(tl.int64)
        tl.store(out_ptr + orow[:, None] * D + d[None, :], y.to(ty), mask=ok)

    @triton.jit
    def _compress_kernel(
        kv_ptr, gate_ptr, pos_ptr, slot_ptr, bkv_ptr, bg_ptr, okv_ptr, og_ptr,
        bias_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr,
        P, D, R, TC1, eps, stride_kv, stride_g, COLS, WIDTH,
        OVERLAP: tl.constexpr, ROPE: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        launch_dependents()
        pp = tl.arange(0, BP)
        pok = pp < P
        for o in range(WIDTH):  # this program's column of each offset, in order
            c = o * COLS + tl.program_id(0)
            pos = tl.load(pos_ptr + c)
            slot = tl.load(slot_ptr + c)
            j = pos % R
            boff = (slot * R + j) * P
            tl.store(bkv_ptr + boff + pp, tl.load(kv_ptr + c * stride_kv + pp, mask=pok), mask=pok)
            tl.store(bg_ptr + boff + pp, tl.load(gate_ptr + c * stride_g + pp, mask=pok), mask=pok)
            if j == R - 1:
                tl.debug_barrier()  # this token's buffer row, written above, is read back below
                _pool_window(
                    bkv_ptr, bg_ptr, okv_ptr, og_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr,
                    slot, pos // R, P, D, R, TC1, eps, OVERLAP, ROPE, BD,
                )  # fmt: skip
                tl.debug_barrier()  # the window is read before a later offset's token replaces an entry

    @triton.jit
    def _pool_window(
        bkv_ptr, bg_ptr, okv_ptr, og_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr,
        slot, window, P, D, R, TC1, eps,
        OVERLAP: tl.constexpr, ROPE: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        """Pool ``slot``'s buffered window ``window`` into its row (and, CSA, the new overlap)."""
        d = tl.arange(0, BD)
        ok = d < D
        ty = rows_ptr.dtype.element_ty
        half = D if OVERLAP else 0  # this window's series: Cb = [D:2D] (CSA), all (HCA)
        # pass 1: max and normaliser of the softmax over slots (online)
        mx = tl.full((BD,), float("-inf"), tl.float32)
        den = tl.zeros((BD,), tl.float32)
        if OVERLAP:
            if window >= 1:
                for s in range(R):
                    g = tl.load(og_ptr + (slot * R + s) * D + d, mask=ok, other=0.0).to(tl.float32)
                    m2 = tl.maximum(mx, g)
                    den = den * tl.exp(mx - m2) + tl.exp(g - m2)
                    mx = m2
        for s in range(R):
            g = tl.load(bg_ptr + (slot * R + s) * P + half + d, mask=ok, other=0.0).to(tl.float32)
            g += tl.load(bias_ptr + s * P + half + d, mask=ok, other=0.0)
            m2 = tl.maximum(mx, g)
            den = den * tl.exp(mx - m2) + tl.exp(g - m2)
            mx = m2
        # pass 2: weights rounded to the kv dtype, products in it, fp32 sum (as the reference)
        acc = tl.zeros((BD,), tl.float32)
        if OVERLAP:
            if window >= 1:
                for s in range(R):
                    g = tl.load(og_ptr + (slot * R + s) * D + d, mask=ok, other=0.0).to(tl.float32)
                    v = tl.load(okv_ptr + (slot * R + s) * D + d, mask=ok, other=0.0).to(tl.float32)
                    wgt = (tl.exp(g - mx) / den).to(ty).to(tl.float32)
                    acc += (v * wgt).to(ty).to(tl.float32)
        for s in range(R):
            g = tl.load(bg_ptr + (slot * R + s) * P + half + d, mask=ok, other=0.0).to(tl.float32)
            g += tl.load(bias_ptr + s * P + half + d, mask=ok, other=0.0)
            v = tl.load(bkv_ptr + (slot * R + s) * P + half + d, mask=ok, other=0.0).to(tl.float32)
            wgt = (tl.exp(g - mx) / den).to(ty).to(tl.float32)
            acc += (v * wgt).to(ty).to(tl.float32)
        x = acc.to(ty).to(tl.float32)
        y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
        y = (tl.load(w_ptr + d, mask=ok, other=0.0) * y).to(ty).to(tl.float32)
        y = _rope_row(y, cos_ptr, sin_ptr, window * R, D, 1.0, ROPE, BD)
        tl.store(rows_ptr + (slot * TC1 + window) * D + d, y.to(ty), mask=ok)
        if OVERLAP:  # the new overlap: this window's Ca series [:D], gates with the bias
            tl.debug_barrier()
            for s in range(R):
                v = tl.load(bkv_ptr + (slot * R + s) * P + d, mask=ok, other=0.0)
                g = tl.load(bg_ptr + (slot * R + s) * P + d, mask=ok, other=0.0).to(tl.float32)
                g += tl.load(bias_ptr + s * P + d, mask=ok, other=0.0)
                tl.store(okv_ptr + (slot * R + s) * D + d, v, mask=ok)
                tl.store(og_ptr + (slot * R + s) * D + d, g.to(og_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu2_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, limit, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < I
        ty = out_ptr.dtype.element_ty
        g = tl.minimum(tl.load(g_ptr + n * stride_g + i, mask=ok, other=0.0).to(tl.float32), limit)
        u = tl.load(u_ptr + n * stride_u + i, mask=ok, other=0.0).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)  # silu in the dtype, as F.silu
        tl.store(out_ptr + n * I + i, (a * u).to(ty), mask=ok)


__all__ = [
    "collapse_norm", "compress_step", "compress_step_reference", "hc_merge", "hc_pre_parts", "norm_rope", "swiglu",
    "collapse_norm_reference", "hc_merge_reference", "norm_rope_reference", "swiglu_reference",
]  # fmt: skip
