"""Prefill attention on Hopper as a warp-specialised Gluon kernel (64 heads × 512 channels per work item, persistent programs).

``kernels.prefill.prefill_attention``'s Triton kernel (``kernels.decode_attention``, one program
per query) holds the 64 × 512 fp32 output and the score tile in one 8-warp program and runs its
two dots, the online softmax and the key gather one after the other: at V4.1-Flash's 8K prefill
it reaches ~1/6 of the tensor cores' rate per key tile (kernels/NOTES.md, run 64). This kernel
splits the same work over three partitions of one program, as FlashMLA does on Hopper:

- a loader warpgroup gathers each tile of ``BN`` key rows (the query's window rows of ``keys``,
  then the rows of ``rows`` that ``row_idx`` names) with ``cp.async`` into one of two shared
  buffers, with the tile's row indices, and arrives on the buffer's barrier as the copies land;
- the softmax warpgroup (the default partition) multiplies q (in shared memory) by the key tile,
  masks, runs the online softmax in fp32, hands ``p`` (bf16) and the rescale factor to the other
  warpgroup through shared memory, and accumulates ``p @ keys[:, :D/2]``;
- the value warpgroup accumulates ``p @ keys[:, D/2:]`` (keys are the values: one MQA head).

So the 64 × 512 accumulator is split over two warpgroups (128 fp32 registers a thread each),
the value warpgroup's dot of one tile overlaps the softmax warpgroup's score dot of the next,
and the gather runs a tile ahead. The program is persistent: one per SM, walking the (query,
64-head block) items; the loader fetches the next item's q as soon as the softmax warpgroup's last
score dot of the current one is done (``q_empty``), and its key tiles as soon as buffers free, so
an item's q load and the previous item's last dots and stores overlap (a launch of one program
per item paid them in turn: ~0.5 ms a layer at V4.1's 8K prefill).
The arithmetic is the Triton kernel's: scores in log2 units (``scale · log2 e``), the max and
sum in fp32, ``p`` rounded to bf16 for the value dot, the sink only in the denominator. The
output is rounded to bf16 once; the caller un-rotates its RoPE channels (``kernels.rope``).

Only for bf16 q/keys with ``D = 512`` and heads a multiple of 64, on compute capability 9.x, under
a Triton release it was validated with on the GPU (``supported``); otherwise callers keep the
Triton kernel. It builds with later releases too (a CPU test compiles it for sm_90a).
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, INTERPRET, num_sms, triton

try:  # Gluon ships with Triton >= 3.5; without it this module only answers ``supported() == False``
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait
    # Triton 3.6 (the lent H200's) names the cp.async copy ``async_copy_global_to_shared``; later
    # releases renamed it ``async_load`` (same arguments) and made the old name raise
    copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - depends on the Triton build
    gluon = None

HEADS = 64  # heads per program: the M of every wgmma
HEAD_DIM = 512
LOG2E = 1.4426950408889634


VALIDATED_TRITON = ((3, 6),)  # the releases whose build of this kernel ran the GPU tests (the lent H200's)


def supported(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None) -> bool:
    """True when this kernel can run ``prefill_attention`` for ``q (S, H, D)``, ``keys`` and
    ``rows``: a validated Triton release (Gluon's semantics move between releases; others keep
    the Triton kernel), compute capability 9.x, bf16, 64-head blocks of 512 channels."""
    if gluon is None or not HAS_TRITON or INTERPRET or not q.is_cuda:
        return False
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) not in VALIDATED_TRITON:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    rows_ok = rows is None or (rows.dtype == q.dtype and rows.stride(-1) == 1)
    return q.dtype == keys.dtype == torch.bfloat16 and rows_ok and keys.stride(-1) == 1 and q.shape[-1] == HEAD_DIM and q.shape[1] % HEADS == 0 and q.stride(-1) == 1


def prefill_attention_ws(
    q: torch.Tensor,
    keys: torch.Tensor,
    swa_slot: torch.Tensor,
    swa_len: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    row_len: torch.Tensor | None = None,
    row_idx: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """``q (S, H, D)`` over, for query ``i``, ``keys[swa_slot[i] + j]`` for ``j < swa_len[i]`` (its
    window) and ``rows[row_idx[i, r]]`` where ``0 <= row_idx[i, r] < row_len[i]`` → ``(S, H, D)`` bf16,
    RoPE channels still rotated. ``keys (L, D)``, ``rows (T, D)`` bf16 with unit last stride."""
    s, h, d = q.shape
    out = torch.empty_like(q)
    if s == 0:
        return out
    has_rows = rows is not None and row_idx is not None and rows.shape[0] > 0 and row_idx.shape[1] > 0
    if not has_rows:
        rows, row_idx, row_len = keys, swa_len.new_zeros(s, 0), swa_len.new_zeros(s)
    k_rows = row_idx.shape[1]
    n_tiles = (window + k_rows + block_n - 1) // block_n
    assert keys.stride(-1) == 1 and rows.stride(-1) == 1 and row_idx.stride(-1) == 1
    n_items = s * (h // HEADS)
    _ws_attention_kernel[(min(n_items, num_sms(q.device)),)](
        q, keys, rows, row_idx, swa_slot.to(torch.int32), swa_len.to(torch.int32), row_len.to(torch.int32), sinks, out,
        q.stride(0), q.stride(1), keys.stride(0), rows.stride(0), row_idx.stride(0), out.stride(0), out.stride(1),
        window, k_rows, n_tiles, n_items, h // HEADS, scale * LOG2E,
        D=d, BN=block_n, HAS_ROWS=has_rows, num_warps=4, maxnreg=168,
    )  # fmt: skip
    return out


if gluon is not None:

    @gluon.jit
    def _loader(args, D: gl.constexpr, BN: gl.constexpr, HAS_ROWS: gl.constexpr):
        """The loader warpgroup: per item its q (once the previous item's scores are done), then
        every key tile and its row indices, by ``cp.async``; ``g`` counts tiles over all items."""
        (q_ptr, keys_ptr, rows_ptr, idx_ptr, slot_ptr, swa_len_ptr, row_len_ptr, out_ptr,
         stride_qb, stride_qh, stride_k, stride_r, stride_ib, stride_ob, stride_oh, W, K_ROWS, n_tiles, n_items, n_hb,
         q_smem, k_smem, i_smem, p_smem, a_smem, f_smem, q_bar, q_empty, k_full, k_empty, p_full, p_empty, fin_bar) = args  # fmt: skip
        CHUNK: gl.constexpr = 16  # rows per cp.async batch: 8 row pointers a thread
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        ld1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, ld))
        g = 0
        it = 0
        for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
            b = item // n_hb
            hb = item % n_hb
            mbarrier.wait(q_empty, (it & 1) ^ 1)  # the softmax's last score dot of the previous item is done
            q_base = q_ptr + b.to(gl.int64) * stride_qb + (hb * 64).to(gl.int64) * stride_qh
            for c in gl.static_range(0, 64, CHUNK):
                ptrs = q_base + (c + offs_c)[:, None].to(gl.int64) * stride_qh + offs_d[None, :]
                copy_to_shared(q_smem.slice(c, CHUNK, dim=0), ptrs)
            async_copy.mbarrier_arrive(q_bar, increment_count=False)
            slot = gl.load(slot_ptr + b).to(gl.int64)
            n_swa = gl.load(swa_len_ptr + b)
            r_len = gl.load(row_len_ptr + b)
            idx_base = idx_ptr + b.to(gl.int64) * stride_ib
            for t in range(n_tiles):
                g = _load_tile(keys_ptr, rows_ptr, idx_base, slot, n_swa, r_len, stride_k, stride_r, W, K_ROWS, t, g,
                               k_smem, i_smem, k_full, k_empty, offs_c, offs_d, D, BN, HAS_ROWS, CHUNK, ld1)  # fmt: skip
            it += 1

    @gluon.jit
    def _load_tile(
        keys_ptr, rows_ptr, idx_base, slot, n_swa, r_len, stride_k, stride_r, W, K_ROWS, t, g,
        k_smem, i_smem, k_full, k_empty, offs_c, offs_d, D: gl.constexpr, BN: gl.constexpr, HAS_ROWS: gl.constexpr,
        CHUNK: gl.constexpr, ld1: gl.constexpr,
    ):  # fmt: skip
        """Tile ``t`` of an item (the program's ``g``-th) into buffer ``g % 2``; returns ``g + 1``."""
        st = g % 2
        mbarrier.wait(k_empty.index(st), ((g // 2) & 1) ^ 1)  # both value dots of tile g - 2 are done
        kbuf = k_smem.index(st)
        for c in gl.static_range(0, BN, CHUNK):
            j = t * BN + c + offs_c  # (CHUNK,) positions in the query's virtual key list
            in_swa = j < W
            ok_swa = in_swa & (j < n_swa)
            src = keys_ptr + (slot + gl.where(ok_swa, j, 0).to(gl.int64)) * stride_k
            ok = ok_swa
            if HAS_ROWS:
                r = j - W
                in_idx = (r >= 0) & (r < K_ROWS)
                loc = gl.load(idx_base + r, mask=in_idx, other=-1)
                ok_row = in_idx & (loc >= 0) & (loc < r_len)
                src = gl.where(in_swa, src, rows_ptr + gl.where(ok_row, loc, 0).to(gl.int64) * stride_r)
                ok = ok_swa | ok_row
            ptrs = gl.max_contiguous(gl.multiple_of(src[:, None] + offs_d[None, :], [1, 16]), [1, 8])  # 16-byte aligned runs (D % 8 == 0)
            copy_to_shared(kbuf.slice(c, CHUNK, dim=0), ptrs, mask=ok[:, None])
        if HAS_ROWS:
            rr = t * BN + gl.arange(0, BN, layout=ld1) - W
            copy_to_shared(i_smem.index(st), idx_base + rr, mask=(rr >= 0) & (rr < K_ROWS))
        async_copy.mbarrier_arrive(k_full.index(st), increment_count=False)
        return g + 1

    @gluon.jit
    def _store_half(out_ptr, stride_ob, stride_oh, b, hb, o, col0, HALF: gl.constexpr, layout: gl.constexpr):
        """Rows ``o (64, HALF)`` fp32 → ``out[b, 64·hb + i, col0 + c]`` rounded to the output dtype."""
        offs_h = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        offs_c = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + b.to(gl.int64) * stride_ob + offs_h[:, None].to(gl.int64) * stride_oh + offs_c[None, :]
        gl.store(ptrs, o.to(out_ptr.dtype.element_ty))

    @gluon.jit
    def _values(args, COL0: gl.constexpr, D: gl.constexpr):
        """A value warpgroup: ``acc += p @ keys[:, COL0 : COL0 + D/2]`` per tile, rescaled as the
        softmax says; at the end normalised by the softmax's final factor and stored."""
        (q_ptr, keys_ptr, rows_ptr, idx_ptr, slot_ptr, swa_len_ptr, row_len_ptr, out_ptr,
         stride_qb, stride_qh, stride_k, stride_r, stride_ib, stride_ob, stride_oh, W, K_ROWS, n_tiles, n_items, n_hb,
         q_smem, k_smem, i_smem, p_smem, a_smem, f_smem, q_bar, q_empty, k_full, k_empty, p_full, p_empty, fin_bar) = args  # fmt: skip
        HALF: gl.constexpr = D // 2
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        g = 0
        it = 0
        for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
            acc = gl.zeros([64, HALF], gl.float32, layout=mma_o)
            for t in range(n_tiles):
                st = g % 2
                mbarrier.wait(p_full.index(st), (g // 2) & 1)
                alpha = a_smem.index(st).load(gl.SliceLayout(1, mma_o))
                acc = acc * alpha[:, None]
                acc = warpgroup_mma(p_smem.index(st), k_smem.index(st).slice(COL0, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(k_empty.index(st), count=1)
                if t < n_tiles - 1:
                    mbarrier.arrive(p_empty.index(st), count=1)
                g += 1
            mbarrier.wait(fin_bar.index(it % 2), (it // 2) & 1)
            fin = f_smem.index(it % 2).load(gl.SliceLayout(1, mma_o))
            # the last tile's p buffer only now: the softmax cannot reach item it + 2 (and its
            # f_smem slot) before this read, even with one tile an item
            mbarrier.arrive(p_empty.index((g - 1) % 2), count=1)
            _store_half(out_ptr, stride_ob, stride_oh, item // n_hb, item % n_hb, acc * fin[:, None], COL0, HALF, mma_o)
            it += 1

    @gluon.jit
    def _values_high(args, D: gl.constexpr, BN: gl.constexpr, HAS_ROWS: gl.constexpr):
        """The value worker: channels ``[D/2, D)``."""
        _values(args, D // 2, D)

    @gluon.jit
    def _scores(q_smem, kbuf, zero_s):
        """``q @ kbufᵀ`` issued on the tensor cores (asynchronous: wait on the returned token)."""
        return warpgroup_mma(q_smem, kbuf.permute((1, 0)), zero_s, use_acc=False, is_async=True)

    @gluon.jit
    def _tile_mask(i_smem, st, t, W, K_ROWS, n_swa, r_len, BN: gl.constexpr, HAS_ROWS: gl.constexpr, layout: gl.constexpr):
        """Which of tile ``t``'s ``BN`` keys the query sees: window keys below ``n_swa``, picked rows
        with an index in ``[0, r_len)`` (the loader's copy of the tile's indices, buffer ``st``)."""
        j = t * BN + gl.arange(0, BN, layout=layout)
        ok = (j < W) & (j < n_swa)
        if HAS_ROWS:
            r = j - W
            loc = i_smem.index(st).load(layout)
            ok = ok | ((r >= 0) & (r < K_ROWS) & (loc >= 0) & (loc < r_len))
        return ok

    @gluon.jit
    def _softmax(args, sinks_ptr, qk_scale, D: gl.constexpr, BN: gl.constexpr, HAS_ROWS: gl.constexpr):
        """The softmax warpgroup: per tile the scores, mask, online softmax, ``p`` and the rescale
        factor to the value worker, and ``acc += p @ keys[:, :D/2]``; at the end the sink and each
        row's final factor. (Issuing the next tile's score dot behind this tile's value dot was
        slower at V4.1's 8K prefill, 2.23 against 2.00 ms: it holds the key buffer a dot longer.)"""
        (q_ptr, keys_ptr, rows_ptr, idx_ptr, slot_ptr, swa_len_ptr, row_len_ptr, out_ptr,
         stride_qb, stride_qh, stride_k, stride_r, stride_ib, stride_ob, stride_oh, W, K_ROWS, n_tiles, n_items, n_hb,
         q_smem, k_smem, i_smem, p_smem, a_smem, f_smem, q_bar, q_empty, k_full, k_empty, p_full, p_empty, fin_bar) = args  # fmt: skip
        HALF: gl.constexpr = D // 2
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        zero_s = gl.zeros([64, BN], gl.float32, layout=mma_s)
        g = 0
        it = 0
        for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
            b = item // n_hb
            hb = item % n_hb
            n_swa = gl.load(swa_len_ptr + b)
            r_len = gl.load(row_len_ptr + b)
            m_i = gl.full([64], -1.0e30, gl.float32, layout=row_s)
            l_i = gl.zeros([64], gl.float32, layout=row_s)
            acc = gl.zeros([64, HALF], gl.float32, layout=mma_o)
            mbarrier.wait(q_bar, it & 1)
            for t in range(n_tiles):
                st = g % 2
                mbarrier.wait(k_full.index(st), (g // 2) & 1)
                fence_async_shared()  # the cp.async writes, seen by the tensor cores' async proxy
                tok = _scores(q_smem, k_smem.index(st), zero_s)
                ok = _tile_mask(i_smem, st, t, W, K_ROWS, n_swa, r_len, BN, HAS_ROWS, gl.SliceLayout(0, mma_s))
                s = warpgroup_mma_wait(0, deps=(tok,))
                if t == n_tiles - 1:  # q is free: the loader may fetch the next item's
                    mbarrier.arrive(q_empty, count=1)
                s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                mbarrier.wait(p_empty.index(st), ((g // 2) & 1) ^ 1)  # the value worker is done with tile g - 2's p
                p_smem.index(st).store(p.to(gl.bfloat16))
                a_smem.index(st).store(alpha)
                fence_async_shared()
                mbarrier.arrive(p_full.index(st), count=1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
                tok = warpgroup_mma(p_smem.index(st), k_smem.index(st).slice(0, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(tok,))
                mbarrier.arrive(k_empty.index(st), count=1)
                g += 1
            offs_h = hb * 64 + gl.arange(0, 64, layout=row_s)
            sink = gl.load(sinks_ptr + offs_h).to(gl.float32) * 1.4426950408889634
            m_f = gl.maximum(m_i, sink)
            a_f = gl.exp2(m_i - m_f)
            fin = a_f / (l_i * a_f + gl.exp2(sink - m_f))
            f_smem.index(it % 2).store(fin)  # two buffers: the value worker reads item i's while this one runs item i + 1
            mbarrier.arrive(fin_bar.index(it % 2), count=1)
            _store_half(out_ptr, stride_ob, stride_oh, b, hb, acc * gl.convert_layout(fin, gl.SliceLayout(1, mma_o))[:, None], 0, HALF, mma_o)
            it += 1

    @gluon.jit
    def _ws_attention_kernel(
        q_ptr, keys_ptr, rows_ptr, idx_ptr, slot_ptr, swa_len_ptr, row_len_ptr, sinks_ptr, out_ptr,
        stride_qb, stride_qh, stride_k, stride_r, stride_ib, stride_ob, stride_oh,
        W, K_ROWS, n_tiles, n_items, n_hb, qk_scale,
        D: gl.constexpr, BN: gl.constexpr, HAS_ROWS: gl.constexpr,
    ):  # fmt: skip
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], gl.bfloat16)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, D], q_layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], k_layout)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BN], p_layout)
        i_smem = gl.allocate_shared_memory(gl.int32, [2, BN], flat)
        a_smem = gl.allocate_shared_memory(gl.float32, [2, 64], flat)
        f_smem = gl.allocate_shared_memory(gl.float32, [2, 64], flat)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        fin_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=128)  # one cp.async arrival per loader thread
        mbarrier.init(q_empty, count=1)
        for i in gl.static_range(2):
            mbarrier.init(fin_bar.index(i), count=1)
            mbarrier.init(k_full.index(i), count=128)
            mbarrier.init(k_empty.index(i), count=2)  # both value dots
            mbarrier.init(p_full.index(i), count=1)
            mbarrier.init(p_empty.index(i), count=1)
        args = (q_ptr, keys_ptr, rows_ptr, idx_ptr, slot_ptr, swa_len_ptr, row_len_ptr, out_ptr,
                stride_qb, stride_qh, stride_k, stride_r, stride_ib, stride_ob, stride_oh, W, K_ROWS, n_tiles, n_items, n_hb,
                q_smem, k_smem, i_smem, p_smem, a_smem, f_smem, q_bar, q_empty, k_full, k_empty, p_full, p_empty, fin_bar)  # fmt: skip
        gl.warp_specialize(
            [(_softmax, (args, sinks_ptr, qk_scale, D, BN, HAS_ROWS)), (_values_high, (args, D, BN, HAS_ROWS)), (_loader, (args, D, BN, HAS_ROWS))],
            [4, 4], [168, 104],
        )  # fmt: skip


__all__ = ["prefill_attention_ws", "supported"]


def _bench(tokens: int, window: int, n_rows: int, picks: int, repeats: int) -> dict:
    """This kernel against ``kernels.prefill``'s Triton kernel (its 64-head launch) at one
    prefill shape: V4.1-Flash's 8K chunk by default (64 heads × 512, 128 window keys, 512 picks
    of 4096 rows, each query's picks drawn among the rows it sees)."""
    from triton.testing import do_bench

    from kernels.prefill import AttentionTuning, prefill_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    keys = torch.randn(window - 1 + tokens, HEAD_DIM, generator=g, device="cuda").bfloat16()
    rows = torch.randn(n_rows, HEAD_DIM, generator=g, device="cuda").bfloat16()
    sinks = torch.randn(HEADS, generator=g, device="cuda")
    row_len = ((torch.arange(tokens, device="cuda") + 1) // max(1, tokens // n_rows)).clamp(max=n_rows).int()
    score = torch.rand(tokens, n_rows, generator=g, device="cuda").masked_fill(torch.arange(n_rows, device="cuda")[None] >= row_len[:, None], -1.0)
    top = score.topk(picks, dim=-1)
    row_idx = torch.where(top.values >= 0, top.indices, -1).int()
    triton_launch = AttentionTuning(block_h=64, block_n=64, num_warps=8, num_stages=2)
    ws = lambda: prefill_attention(q, keys, window - 1, sinks, window, rows, row_len, row_idx)  # noqa: E731
    old = lambda: prefill_attention(q, keys, window - 1, sinks, window, rows, row_len, row_idx, tuning=triton_launch)  # noqa: E731
    from kernels.prefill import prefill_attention_reference

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x.double() - y.double()).norm() / y.double().norm()).item()

    a, b = ws(), old()
    n = min(tokens, 256)  # the fp32 reference on the first queries
    ref = prefill_attention_reference(q[:n].float(), keys[: window - 1 + n].float(), window - 1, sinks, window, rows.float(), row_len[:n], row_idx[:n])
    flops = 4.0 * tokens * HEADS * HEAD_DIM * (window + picks)
    out: dict = {"tokens": tokens, "window": window, "rows": n_rows, "picks": picks, "ws_used": supported(q, keys, rows),
                 "rel_diff_vs_triton": rel(a, b), "ws_rel_err_vs_fp32": rel(a[:n], ref), "triton_rel_err_vs_fp32": rel(b[:n], ref)}  # fmt: skip
    for name, fn in (("ws", ws), ("triton", old)):
        ms = sorted(do_bench(fn, warmup=5, rep=50) for _ in range(repeats))[repeats // 2]
        out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
    return out


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--picks", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = _bench(a.tokens, a.window, a.rows, a.picks, a.repeats)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
