"""Batched decode attention of DeepSeek-V4: one query per sequence, one shared key=value head.

Each sequence ``b`` attends with its ``H`` query heads over

- its sliding window: ``swa[slot_b, :swa_len[b]]`` — a ring buffer of the last ``W`` key rows
  (write token ``pos`` at slot ``pos % W``; ``swa_len = min(num_tokens, W)``, the current token
  included; order inside the window does not matter, softmax is permutation invariant), and
- its compressed rows, a segment ``rows[row_start[b] : row_start[b] + row_len[b]]`` of one pool
  shared by all sequences: all of them (HCA), or only ``row_idx[b]`` (CSA: the indexer's top-k,
  indices local to the segment, ``-1`` = no row).

Multi-query (a speculative verify step's ``1 + k`` offsets of a slot in one launch): queries are
offset-major, ``fresh_cols`` per offset, query ``b`` is offset ``j = b // fresh_cols`` of its slot.
Its window is then the ring *before* the step wrote anything — the ``swa_len[b]`` entries ending
just before ring row ``swa_end[b]`` (cyclically: the newest at ``swa_end[b] - 1``) — plus the
step's own new keys ``fresh[b - j·fresh_cols], fresh[b - (j-1)·fresh_cols], .., fresh[b]`` (its
slot's offsets ``0 .. j``); the caller writes the new keys into the ring after the call, so no
offset overwrites a key an earlier one reads. Its rows are bounded per query as above
(``row_len[b]``, ``row_idx[b]``), so offset ``j`` sees the rows the offsets before it closed.

Softmax runs over ``[logits·scale, sink_h]`` with the sink column dropped (per-head sink logits in
the denominator), ``scale = D**-0.5`` by default; output ``(B, H, D)`` still carries the keys'
RoPE, which the caller undoes (``apply_rope(out, cos, -sin)``) as ``engine.model.attention`` does.

Layout (row ``D`` elements contiguous in every tensor)::

    q        (B, H, D)     one query per sequence
    swa      (S, W, D)     window ring buffers, S ≥ B slots; swa_slot (B,) picks one (default b)
    swa_len  (B,)   int    valid window rows (the first swa_len of the slot; with swa_end, the last
                           swa_len before row swa_end, cyclically)
    fresh    (B, D)        optional: the step's new keys (multi-query), fresh_cols queries per offset
    rows     (R, D)        compressed-row pool (CSA or HCA rows of every sequence, one layer)
    row_start, row_len (B,) int   each sequence's segment of the pool
    row_idx  (B, K) int    optional, CSA: local indices into the segment, -1 = padding
    sinks    (H,)   fp32

The Triton kernel is flash-decoding: grid ``(B, H/BH, splits)``; each program holds ``BH`` heads'
queries and walks its share of the key list (window rows first, then compressed rows) in tiles of
``BN`` rows with an online softmax in fp32 (the virtual key list: ``[ring (W) | fresh | rows]``).
With ``splits > 1`` partial (max, sum, acc) go to a small combine kernel, which adds the sinks
(and un-rotates the output when asked); otherwise the sinks are added in place.
"""

from __future__ import annotations

import torch

from kernels._common import (
    HAS_TRITON,
    dot_precision,
    launch_dependents,
    mma,
    next_pow2,
    num_sms,
    tl,
    triton,
    use_triton,
)

LOG2E = 1.4426950408889634


def decode_attention_reference(
    q: torch.Tensor,
    swa: torch.Tensor,
    swa_len: torch.Tensor,
    sinks: torch.Tensor,
    rows: torch.Tensor | None = None,
    row_start: torch.Tensor | None = None,
    row_len: torch.Tensor | None = None,
    row_idx: torch.Tensor | None = None,
    swa_slot: torch.Tensor | None = None,
    scale: float | None = None,
    swa_end: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    fresh_cols: int = 1,
) -> torch.Tensor:
    """Per-sequence loop with the math of ``kernels.reference.attend_with_sinks`` for one query. → ``(B, H, D)``."""
    b_size, _, d = q.shape
    w = swa.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for b in range(b_size):
        slot = b if swa_slot is None else int(swa_slot[b])
        n_w = int(swa_len[b])
        if swa_end is None:
            keys = swa[slot, :n_w]  # (n_w, D)
        else:  # the n_w entries before swa_end, oldest first
            keys = swa[slot, (int(swa_end[b]) - n_w + torch.arange(n_w, device=swa.device)) % w]
        if fresh is not None:  # its slot's new keys of offsets 0 .. b // fresh_cols
            keys = torch.cat([keys, fresh[b % fresh_cols :: fresh_cols][: b // fresh_cols + 1]])
        if rows is not None:
            a, n = int(row_start[b]), int(row_len[b])
            seg = rows[a : a + n]  # (n, D)
            if row_idx is not None:
                idx = row_idx[b].long()
                seg = seg[idx[(idx >= 0) & (idx < n)]]  # (k, D)
            keys = torch.cat([keys, seg])
        logits = torch.matmul(q[b], keys.t()) * scale  # (H, K) in q's dtype, as the model
        combined = torch.cat([logits.float(), sinks.float()[:, None]], dim=-1)  # (H, K+1)
        probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[:, :-1]
        out[b] = torch.matmul(probs.to(keys.dtype), keys)
    return out


def decode_attention(
    q: torch.Tensor,
    swa: torch.Tensor,
    swa_len: torch.Tensor,
    sinks: torch.Tensor,
    rows: torch.Tensor | None = None,
    row_start: torch.Tensor | None = None,
    row_len: torch.Tensor | None = None,
    row_idx: torch.Tensor | None = None,
    swa_slot: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    max_rows: int | None = None,
    block_h: int = 16,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    q_norm_eps: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    fold_q: int = 1,
    rope_out: bool = True,
    rope_pos: torch.Tensor | None = None,
    swa_end: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    fresh_cols: int = 1,
) -> torch.Tensor:
    """Decode attention for ``B`` sequences (layout in the module docstring). → ``(B, H, D)``.

    ``swa_end (B,)`` int / ``fresh (B, D)`` with ``fresh_cols``: the multi-query form (module
    docstring): window = the ring's ``swa_len`` entries before ``swa_end`` plus the fresh keys of
    the query's slot up to its own offset. Either may be given alone.

    ``q_norm_eps`` / ``rope = (cos, sin)`` (tables ``(B, R/2)``, row ``b`` for query ``b``): ``q`` is
    raw, the kernel applies the unweighted RMS norm and the RoPE of the trailing ``R`` channels as it
    loads it (the rounding of ``fused.norm_rope``), and un-rotates the output (``-sin``) before its
    store — the prefill path's two ``norm_rope`` passes folded in (one split when q is folded; with
    ``fold_q=0`` and no ``q_norm_eps`` the output is un-rotated by the last kernel, split or not).
    ``rope_pos (B,)`` int: query ``b`` uses table row ``rope_pos[b]`` (full position tables, e.g. the
    static decode step's), else row ``b``. ``fold_q``: 0 = q
    comes normalised and rotated (only the output is un-rotated), 1 = q is normalised and rotated in
    registers as it loads, 2 = the main dot takes the raw q, the head norm scales the logits and a
    second small dot over the 64 rope channels adds the rotation's difference (needs ``rope``);
    ``rope_out``: un-rotate the output.

    ``max_rows`` (HCA, no ``row_idx``): an upper bound of ``row_len``; given, the call does no
    host sync (CUDA-graph capturable), else it reads ``row_len.max()``.
    ``block_h/block_n/num_splits/num_warps/num_stages`` tune the Triton kernel (defaults suit
    H=64, D=512 on an H200); they are ignored by the reference path.
    """
    if not use_triton(q):  # the reference, with the folded norm / RoPE passes as fused.norm_rope runs them
        from kernels.fused import norm_rope_reference

        at = rope_pos if rope_pos is not None else torch.arange(q.shape[0], device=q.device)
        cos_t, sin_t = rope if rope is not None else (None, None)
        if q_norm_eps is not None and fold_q > 0:
            q = norm_rope_reference(q, None, 2, q_norm_eps, cos_t, sin_t, at if rope is not None else None)
        elif rope is not None and fold_q > 0:
            q = norm_rope_reference(q, None, 0, 0.0, cos_t, sin_t, at)
        out = decode_attention_reference(q, swa, swa_len, sinks, rows, row_start, row_len, row_idx, swa_slot, scale, swa_end, fresh, fresh_cols)
        return out if rope is None or not rope_out else norm_rope_reference(out, None, 0, 0.0, cos_t, sin_t, at, sign=-1.0)
    b_size, h, d = q.shape
    w = swa.shape[1]
    assert swa.shape[2] == d and q.stride(-1) == 1 and swa.stride(-1) == 1, "rows must be contiguous in D"
    has_rows = rows is not None
    indexed = has_rows and row_idx is not None
    if has_rows:
        assert row_start is not None and row_len is not None, "rows need row_start and row_len"
        assert rows.shape[1] == d and rows.stride(-1) == 1
        k_rows = row_idx.shape[1] if indexed else max_rows if max_rows is not None else int(row_len.max()) if b_size else 0
    else:
        k_rows = 0
    scale = d**-0.5 if scale is None else scale
    fp32 = q.dtype == torch.float32
    block_n = block_n or (16 if fp32 else 32)
    num_warps = num_warps or (4 if block_h <= 16 else 8)
    num_stages = num_stages or (1 if fp32 else 2)
    d_pad = next_pow2(d)
    n_hb = triton.cdiv(h, block_h)
    n_fresh = triton.cdiv(b_size, fresh_cols) if fresh is not None else 0  # offsets: fresh keys at most
    if fresh is not None:
        assert fresh.shape == (b_size, d) and fresh.stride(-1) == 1, "one fresh key row per query"
    tiles = max(1, triton.cdiv(w + n_fresh + k_rows, block_n))
    if num_splits is None:
        num_splits = max(1, min(2 * num_sms(q.device) // max(1, b_size * n_hb), tiles // 2))
    if q_norm_eps is not None or (rope is not None and fold_q > 0):
        num_splits = 1  # q normalised / rotated as it loads: one program per head block
    num_splits = max(1, min(num_splits, tiles))
    tiles_per_split = triton.cdiv(tiles, num_splits)
    num_splits = triton.cdiv(tiles, tiles_per_split)

    out = torch.empty_like(q)
    dummy_i = torch.empty(1, dtype=torch.int32, device=q.device)  # never read (no fill launch)
    rows_t = rows if has_rows else swa
    if num_splits > 1:
        part_acc = torch.empty(b_size, h, num_splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b_size, h, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    if fold_q == 2 and (rope is None or 2 * rope[0].shape[1] < 16):
        fold_q = 1  # the correction dot needs K ≥ 16 rope channels on the GPU
    if rope is not None:
        cos_t, sin_t = rope
        assert cos_t.is_contiguous() and sin_t.is_contiguous() and (rope_pos is not None or cos_t.shape[0] >= b_size)
        rope_dim = 2 * cos_t.shape[1]
    else:
        cos_t = sin_t = q
        rope_dim = 0
    _decode_attn_kernel[(b_size, n_hb, num_splits)](
        q, swa, swa_len, swa_slot if swa_slot is not None else dummy_i,
        rows_t, row_start if has_rows else dummy_i, row_len if has_rows else dummy_i,
        row_idx if indexed else dummy_i, sinks,
        out, part_acc, part_ml, cos_t, sin_t, rope_pos if rope_pos is not None else dummy_i, float(q_norm_eps or 0.0),
        swa_end if swa_end is not None else dummy_i, fresh if fresh is not None else q,
        h, d, w, k_rows, n_fresh, fresh_cols,
        q.stride(0), q.stride(1), swa.stride(0), swa.stride(1), rows_t.stride(0),
        row_idx.stride(0) if indexed else 0, out.stride(0), out.stride(1), fresh.stride(0) if fresh is not None else 0,
        scale * LOG2E, tiles_per_split,
        D_PAD=d_pad, BH=block_h, BN=block_n, HAS_ROWS=has_rows, INDEXED=indexed,
        HAS_SLOT=swa_slot is not None, SPLIT=num_splits > 1, PRECISION=dot_precision(q.dtype),
        Q_NORM=q_norm_eps is not None and fold_q > 0, ROPE=rope_dim, QMODE=fold_q if (q_norm_eps is not None or rope is not None) else 0,
        ROPE_OUT=rope is not None and rope_out, HAS_POS=rope_pos is not None,
        RING_END=swa_end is not None, HAS_FRESH=fresh is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_attn_combine_kernel[(b_size, n_hb)](
            part_acc, part_ml, sinks, out, h, d, num_splits, out.stride(0), out.stride(1),
            cos_t, sin_t, rope_pos if rope_pos is not None else dummy_i,
            D_PAD=d_pad, BH=block_h, ROPE=rope_dim, ROPE_OUT=rope is not None and rope_out,
            HAS_POS=rope_pos is not None, num_warps=4,
        )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def _rope_pairs(x, xp, cos_ptr, sin_ptr, p, offs_d, is_r, D, sign, ROPE: tl.constexpr):
        """RoPE of fp32 ``x (BH, C)`` (channels ``offs_d``) given each channel's pair partner
        ``xp`` (channel ``d ^ 1``): channels where ``is_r`` rotate by table row ``p`` (interleaved
        pairs of the trailing ``ROPE`` channels), rounded to the table's dtype, as ``fused._rope_row``."""
        ty = cos_ptr.dtype.element_ty
        half = ROPE // 2
        j = tl.where(is_r, (offs_d - (D - ROPE)) // 2, 0)
        c = tl.load(cos_ptr + p.to(tl.int64) * half + j, mask=is_r, other=1.0).to(tl.float32)[None, :]
        s = (tl.load(sin_ptr + p.to(tl.int64) * half + j, mask=is_r, other=0.0).to(tl.float32) * sign)[None, :]
        even = (offs_d % 2 == 0)[None, :]
        rot = tl.where(even, x * c - xp * s, x * c + xp * s).to(ty).to(tl.float32)
        return tl.where(is_r[None, :], rot, x)

    @triton.jit
    def _decode_attn_kernel(
        q_ptr, swa_ptr, swa_len_ptr, swa_slot_ptr,
        rows_ptr, row_start_ptr, row_len_ptr, row_idx_ptr, sinks_ptr,
        out_ptr, part_acc_ptr, part_ml_ptr, cos_ptr, sin_ptr, pos_ptr, q_eps,
        swa_end_ptr, fresh_ptr,
        H, D, W, K_ROWS, N_FRESH, FRESH_COLS,
        stride_qb, stride_qh, stride_ss, stride_sw, stride_r, stride_ib, stride_ob, stride_oh, stride_f,
        qk_scale, tiles_per_split,
        D_PAD: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, HAS_ROWS: tl.constexpr,
        INDEXED: tl.constexpr, HAS_SLOT: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
        Q_NORM: tl.constexpr = False, ROPE: tl.constexpr = 0, QMODE: tl.constexpr = 0, ROPE_OUT: tl.constexpr = False,
        HAS_POS: tl.constexpr = False, RING_END: tl.constexpr = False, HAS_FRESH: tl.constexpr = False,
    ):  # fmt: skip
        launch_dependents()  # a GEMV after this (kernels.gemv, pdl) streams its first weights meanwhile
        b = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        n_split = tl.num_programs(2)
        if HAS_POS:  # the rope tables' row of this query
            rp = tl.load(pos_ptr + b)
        else:
            rp = b
        offs_h = hb * BH + tl.arange(0, BH)  # (BH,)
        offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
        h_ok = offs_h < H
        d_ok = offs_d < D
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=h_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (BH, D_PAD)
        if QMODE == 2:  # raw q in the main dot; norm as a logit scale, rotation as a correction dot
            ty = q.dtype
            row_scale = tl.full([BH], 1.0, dtype=tl.float32)
            if Q_NORM:
                qf = q.to(tl.float32)
                row_scale = (1.0 / tl.sqrt(tl.sum(qf * qf, axis=1) / D + q_eps)).to(ty).to(tl.float32)
            offs_q = D - ROPE + tl.arange(0, ROPE)
            q_rows = q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
            qr = tl.load(q_rows + offs_q[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
            qrp = tl.load(q_rows + (offs_q ^ 1)[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
            qr = (qr * row_scale[:, None]).to(ty).to(tl.float32)
            qrp = (qrp * row_scale[:, None]).to(ty).to(tl.float32)
            rot = _rope_pairs(qr, qrp, cos_ptr, sin_ptr, rp, offs_q, offs_q >= 0, D, 1.0, ROPE)
            dq = (rot - qr).to(ty)  # (BH, ROPE): rope(norm(q)) - norm(q) on the rope channels
            row_scale = row_scale * qk_scale
        elif QMODE == 1:
            # elementwise in q's own register layout (a split/join of the (64, 512) tile cost the
            # 8K prefill ~7 ms of attention time, run 8): each channel's RoPE partner (d ^ 1) is
            # loaded a second time (from L1/L2) instead of shuffled
            ty = q.dtype
            qf = q.to(tl.float32)
            if Q_NORM:  # unweighted RMS norm of each head, rounded as fused.norm_rope mode 2
                rs = (1.0 / tl.sqrt(tl.sum(qf * qf, axis=1) / D + q_eps)).to(ty).to(tl.float32)
                qf = (qf * rs[:, None]).to(ty).to(tl.float32)
            if ROPE > 0:
                is_r = (offs_d >= D - ROPE) & d_ok
                qp = tl.load(
                    q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + (offs_d ^ 1)[None, :],
                    mask=h_ok[:, None] & is_r[None, :], other=0.0,
                ).to(tl.float32)
                if Q_NORM:
                    qp = (qp * rs[:, None]).to(ty).to(tl.float32)
                qf = _rope_pairs(qf, qp, cos_ptr, sin_ptr, rp, offs_d, is_r, D, 1.0, ROPE)
            q = qf.to(ty)

        n_swa = tl.load(swa_len_ptr + b).to(tl.int32)
        if HAS_SLOT:
            slot = tl.load(swa_slot_ptr + b).to(tl.int64)
        else:
            slot = b.to(tl.int64)
        swa_base = swa_ptr + slot * stride_ss
        if HAS_ROWS:
            r_start = tl.load(row_start_ptr + b).to(tl.int64)
            r_len = tl.load(row_len_ptr + b).to(tl.int32)
        else:
            r_start = 0
            r_len = 0

        if RING_END:  # the window's newest ring row is swa_end - 1 (cyclically)
            s_end = tl.load(swa_end_ptr + b).to(tl.int32)
        if HAS_FRESH:  # this query is offset ``jq`` of its slot: fresh keys of offsets 0 .. jq
            jq = b // FRESH_COLS
            n_fr = jq + 1
        else:
            n_fr = 0

        t_lo = sp * tiles_per_split
        t_hi = t_lo + tiles_per_split
        if not INDEXED:  # tiles past this sequence's last valid key hold nothing
            t_hi = tl.minimum(t_hi, tl.cdiv(W + N_FRESH + r_len, BN))

        m_i = tl.full([BH], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, D_PAD], dtype=tl.float32)
        for t in range(t_lo, t_hi):
            j = t * BN + tl.arange(0, BN)  # (BN,) position in the virtual key list
            in_swa = j < W
            if RING_END:
                ok_swa = in_swa & ((s_end - 1 - j + W) % W < n_swa)  # distance from the newest row
            else:
                ok_swa = in_swa & (j < n_swa)
            f = j - W
            r = f - N_FRESH
            if INDEXED:
                in_idx = (r >= 0) & (r < K_ROWS)
                loc = tl.load(row_idx_ptr + b.to(tl.int64) * stride_ib + r, mask=in_idx, other=-1)
                ok_row = in_idx & (loc >= 0) & (loc < r_len)
            else:
                loc = r
                ok_row = (r >= 0) & (r < r_len)
            swa_off = tl.where(ok_swa, j, 0).to(tl.int64) * stride_sw
            row_off = (r_start + tl.where(ok_row, loc, 0).to(tl.int64)) * stride_r
            if HAS_ROWS:
                ptrs = tl.where(in_swa[:, None], swa_base + swa_off[:, None], rows_ptr + row_off[:, None])
            else:
                ptrs = swa_base + swa_off[:, None]
            if HAS_FRESH:  # fresh key f: offset f of this query's slot, column b - (jq - f)·FRESH_COLS
                ok_fr = (f >= 0) & (f < n_fr)
                fr_off = (b - (jq - tl.where(ok_fr, f, jq)) * FRESH_COLS).to(tl.int64) * stride_f
                ptrs = tl.where(ok_fr[:, None], fresh_ptr + fr_off[:, None], ptrs)
                ok = ok_swa | ok_row | ok_fr
            else:
                ok = ok_swa | ok_row
            k = tl.load(ptrs + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)  # (BN, D_PAD)
            if QMODE == 2:
                kr = tl.load(ptrs + offs_q[None, :], mask=ok[:, None], other=0.0)  # (BN, ROPE)
                s = mma(q, tl.trans(k), PRECISION) * row_scale[:, None] + mma(dq, tl.trans(kr), PRECISION) * qk_scale
            else:
                s = mma(q, tl.trans(k), PRECISION) * qk_scale  # (BH, BN), log2 units
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # (BH, BN)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + mma(p.to(k.dtype), k, PRECISION)
            m_i = m_new

        if SPLIT:
            row = (b.to(tl.int64) * H + offs_h) * n_split + sp  # (BH,) index of (b, h, split)
            tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
            tl.store(part_ml_ptr + row * 2, m_i, mask=h_ok)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_ok)
        else:
            sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            denom = l_i * alpha + tl.exp2(sink - m_f)
            o = acc * (alpha / denom)[:, None]
            o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
            if ROPE_OUT:
                _undo_rope_out(out_ptr + b.to(tl.int64) * stride_ob, offs_h, h_ok, stride_oh, cos_ptr, sin_ptr, rp, D, ROPE)

    @triton.jit
    def _undo_rope_out(o_ptr, offs_h, h_ok, stride_oh, cos_ptr, sin_ptr, p, D, ROPE: tl.constexpr):
        """Undo the values' rotation at table row ``p`` in the stored output rows ``o_ptr`` (heads
        ``offs_h``), as ``fused.norm_rope(sign=-1)``: the rope channels and their partners are read
        back (this program's own writes, after a barrier), rotated, and written again."""
        offs_r = D - ROPE + tl.arange(0, ROPE)
        r_ptrs = o_ptr + offs_h[:, None] * stride_oh
        tl.debug_barrier()
        orr = tl.load(r_ptrs + offs_r[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        orp = tl.load(r_ptrs + (offs_r ^ 1)[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        tl.debug_barrier()
        on = _rope_pairs(orr, orp, cos_ptr, sin_ptr, p, offs_r, offs_r >= 0, D, -1.0, ROPE)
        tl.store(r_ptrs + offs_r[None, :], on.to(o_ptr.dtype.element_ty), mask=h_ok[:, None])

    @triton.jit
    def _decode_attn_combine_kernel(
        part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, H, D, n_split, stride_ob, stride_oh,
        cos_ptr, sin_ptr, pos_ptr,
        D_PAD: tl.constexpr, BH: tl.constexpr, ROPE: tl.constexpr, ROPE_OUT: tl.constexpr, HAS_POS: tl.constexpr,
    ):  # fmt: skip
        launch_dependents()
        b = tl.program_id(0)
        hb = tl.program_id(1)
        offs_h = hb * BH + tl.arange(0, BH)
        offs_d = tl.arange(0, D_PAD)
        h_ok = offs_h < H
        d_ok = offs_d < D
        sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = sink
        l_f = tl.full([BH], 1.0, dtype=tl.float32)  # the sink's own exp2(sink - m_f)
        acc = tl.zeros([BH, D_PAD], dtype=tl.float32)
        for s in range(n_split):
            row = (b.to(tl.int64) * H + offs_h) * n_split + s
            m_s = tl.load(part_ml_ptr + row * 2, mask=h_ok, other=-1.0e30)
            l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=h_ok, other=0.0)
            a_s = tl.load(part_acc_ptr + row[:, None] * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            m_new = tl.maximum(m_f, m_s)
            alpha = tl.exp2(m_f - m_new)
            beta = tl.exp2(m_s - m_new)
            l_f = l_f * alpha + l_s * beta
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            m_f = m_new
        o = acc / l_f[:, None]
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
        if ROPE_OUT:
            if HAS_POS:
                rp = tl.load(pos_ptr + b)
            else:
                rp = b
            _undo_rope_out(out_ptr + b.to(tl.int64) * stride_ob, offs_h, h_ok, stride_oh, cos_ptr, sin_ptr, rp, D, ROPE)


def decode_attention_cost(b: int, h: int, d: int, keys_per_seq: float, elem: int = 2) -> tuple[float, float]:
    """Fewest bytes moved and FLOPs of one call: q/out once, each sequence's keys once."""
    nbytes = elem * (2 * b * h * d + b * keys_per_seq * d)
    flops = 4.0 * b * h * keys_per_seq * d
    return nbytes, flops


__all__ = ["decode_attention", "decode_attention_cost", "decode_attention_reference"]
