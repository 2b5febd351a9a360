"""Prefill pieces of DeepSeek-V4's general path on the GPU: attention, indexer top-k, mHC input.

The general path (``engine.model.attention``) computes prefill attention with materialised
scores per 512-query tile, the CSA indexer as an fp32 ``(S, Hi, T)`` product, and the mHC input
mix with fp32 copies of the streams. On CUDA (bf16/fp16 by default) it calls these instead:

``prefill_attention``: every query ``i`` of a chunk attends, with per-head sinks, over

- its window: ``keys[max(i, pad) : i + W]`` of the padded chunk keys ``keys (W-1+S, D)`` (the
  previous ``W-1`` key rows of the sequence, left-padded with ``pad`` rows that are never read,
  then the chunk's own keys; row ``i + W - 1`` is query ``i``'s own key), and
- its compressed rows ``rows (T, D)``: the first ``row_len[i]`` (HCA), or the ones ``row_idx[i]``
  names (CSA top-k, local indices, ``-1`` = none, each ``< row_len[i]``).

It is flash attention over a per-query virtual key list, the kernel of ``kernels.decode_attention``
(one program per query and block of heads, online softmax in fp32, keys gathered by pointer): the
window is handed over as a strided ``unfold`` view of ``keys`` (slot ``max(i, pad)``, ``swa_len``
the count of real keys), so no ``(S, W, D)`` copy and no score tensor is ever built. On Hopper,
bf16 heads of 512 channels in blocks of 64 with ``row_idx`` (or no rows) take
``kernels.prefill_attention_ws``'s warp-specialised kernel instead (the same arithmetic, 1.8× as
fast at V4.1-Flash's 8K prefill), the output's RoPE undone after it by ``kernels.rope``.

``prefill_topk``: the indexer's top-k rows of every query, scores by ``kernels.indexer``'s fused
prefill kernel (a few queries' ``(Hi, Di)`` heads per program against each ``(Di, BT)`` row tile
below their row counts, relu, weighted head sum; the ``(S, Hi, T)`` logits never reach memory),
then ``torch.topk``; queries in tiles so that the ``(S, T)`` fp32 scores stay small.

``hc_pre_norm``: ``HyperConnection`` + the block's input ``RMSNorm``: the ``(N, hc·H) × (hc·H, M)``
mix and the sum of squares as blocked dots over ``BM`` tokens (the static step's
``hc_pre_parts`` re-reads ``fn`` per token, which costs ~2 ms at 8K tokens). The fp32 dot: bf16
streams times the three bf16 terms of ``fn`` (``split_bf16x3``: exact products, fp32 sums; 0.12 ms
per 8K call), fp32 streams as ``tf32x3`` on the tensor cores (~fp32 accuracy; 0.31 ms for bf16
streams widened, and plain ``ieee`` FMA dots took 1.3 ms). Then ``kernels.mhc.hc_mix_parts``
(gates + Sinkhorn) and ``kernels.fused.collapse_norm``.

Each has a PyTorch reference (the general path's math); off CUDA without the interpreter the
public functions run those. Their launch settings are a ``PrefillTuning`` the caller passes (the
model holds one, ``engine.model.model.ModelTuning``); the defaults are the measured choices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from kernels.fused import NormRopeTuning
from kernels.prefill_attention_ws import prefill_attention_ws
from kernels.prefill_attention_ws import supported as ws_supported
from kernels.rope import rope_inplace
from kernels._common import (
    HAS_TRITON,
    INTERPRET,
    dot_precision,
    mma,
    next_pow2,
    tl,
    triton,
    use_triton,
)


@dataclass(frozen=True)
class IndexerTuning:
    """``prefill_topk``: queries per scoring call (``(query_tile, T)`` fp32 scores) and the
    ``indexer_scores_prefill`` launch (queries per program, rows per tile, warps; the trace
    script sweeps it)."""

    query_tile: int = 4096
    block_q: int = 2
    block_t: int = 64
    num_warps: int = 8


@dataclass(frozen=True)
class AttentionTuning:
    """The attention kernel's launch (``kernels.decode_attention``'s keywords; the bench sweeps them)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class HcPreTuning:
    """``hc_pre_block_parts`` launch: rows per program, K step, warps, pipeline stages, and the
    programs per SM the K splits aim at (at most 8 splits). Run 8's (64, 64, 4, default 3, 2) left
    the 8K call at 0.42 ms for 268 MB of streams (0.6 TB/s: 384 programs, latency-bound); run 9:
    8 programs per SM, 0.41 → 0.31 ms. ``bf16x3`` (bf16 streams): the fp32 ``fn`` as three bf16
    terms (``split_bf16x3``) and three bf16 dots instead of the streams widened to fp32 for
    ``precision`` (tf32x3: near fp32; ieee: exact FMA dots, where a Triton build lacks tf32x3: a
    call that fails to build with tf32x3 runs again with ieee)."""

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 8
    bf16x3: bool = True
    precision: str = "ieee" if INTERPRET else "tf32x3"


@dataclass(frozen=True)
class PrefillTuning:
    """Every launch setting of this module. ``attention`` None: the heuristic in
    ``prefill_attention``. ``fold_norm_rope`` (``Attention._forward_fast``, one-sequence prefill):
    0 = separate norm_rope passes; 1 = q norm + RoPE in the attention kernel's registers and the
    output's RoPE undo in its epilogue; 2 = as 1 with the q norm as a logit scale and the rotation
    as a 64-channel correction dot; 3 = only the output's undo. Run 8: folding the q norm/RoPE into
    the kernel (1 or 2) made the attention kernel 9.5 → 15–16 ms at 8K (it sits at the register
    limit: q 64×512 and the 64×512 fp32 accumulator), more than the 4 ms of passes it saves;
    folding only the output's undo (3) is neutral to −1 ms. ``norm_rope``: the launch of the
    prefill path's ``kernels.fused.norm_rope`` passes."""

    indexer: IndexerTuning = field(default_factory=IndexerTuning)
    attention: AttentionTuning | None = None
    fold_norm_rope: int = 3
    hc_pre: HcPreTuning = field(default_factory=HcPreTuning)
    norm_rope: NormRopeTuning = field(default_factory=NormRopeTuning)


PREFILL = PrefillTuning()  # the default


# ---- attention ----------------------------------------------------------------------------------
def prefill_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    pad: int,
    sinks: torch.Tensor,
    window: int,
    rows: torch.Tensor | None = None,
    row_len: torch.Tensor | None = None,
    row_idx: torch.Tensor | None = None,
    scale: float | None = None,
    tile: int = 512,
    q_norm_eps: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    fold_q: int = 1,
    rope_out: bool = True,
) -> torch.Tensor:
    """``attend_with_sinks`` per tile of queries, as ``Attention._attend_sequence`` calls it.
    ``q (S, H, D)``, ``keys (W-1+S, D)`` → ``(S, H, D)``. With ``q_norm_eps``/``rope`` the raw ``q``
    goes through ``fused.norm_rope`` first (``fold_q > 0``) and the output through its inverse RoPE
    after (``rope_out``)."""
    from kernels.reference import attend_with_sinks, hide
    from kernels.fused import norm_rope_reference

    if q_norm_eps is not None or rope is not None:
        cos_t, sin_t = rope if rope is not None else (None, None)
        at = torch.arange(q.shape[0], device=q.device)
        if fold_q:
            q = norm_rope_reference(q, None, 0 if q_norm_eps is None else 2, q_norm_eps or 0.0, cos_t, sin_t, at)
        out = prefill_attention_reference(q, keys, pad, sinks, window, rows, row_len, row_idx, scale, tile)
        return out if rope is None or not rope_out else norm_rope_reference(out, None, 0, 0.0, cos_t, sin_t, at, sign=-1.0)

    s, _, d = q.shape
    scale = d**-0.5 if scale is None else scale
    win = keys.unfold(0, window, 1).transpose(1, 2)  # (S, W, D)
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(window, device=q.device)[None, :]
    win_bias = hide(i + j < pad, q.dtype) if pad else None
    out = torch.empty_like(q)
    for t0 in range(0, s, tile):
        t = slice(t0, min(t0 + tile, s))
        extra = extra_bias = None
        if rows is not None and rows.shape[0]:
            if row_idx is None:
                vis = torch.arange(rows.shape[0], device=q.device)[None, :] < row_len[t, None]
                extra, extra_bias = rows, hide(~vis, q.dtype)
            else:
                idx = row_idx[t].long()
                ok = (idx >= 0) & (idx < row_len[t, None])
                extra, extra_bias = rows[idx.clamp(min=0)], hide(~ok, q.dtype)
        wb = None if win_bias is None else win_bias[t]
        out[t] = attend_with_sinks(q[t], win[t], wb, extra, extra_bias, sinks, scale)
    return out


def prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    pad: int,
    sinks: torch.Tensor,
    window: int,
    rows: torch.Tensor | None = None,
    row_len: torch.Tensor | None = None,
    row_idx: torch.Tensor | None = None,
    scale: float | None = None,
    q_norm_eps: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    fold_q: int = 1,
    rope_out: bool = True,
    tuning: AttentionTuning | None = None,
) -> torch.Tensor:
    """Prefill attention of one chunk (layout in the module docstring). → ``(S, H, D)``.

    ``row_len (S,)`` int: rows visible to each query (HCA: the first ``row_len``; CSA: the bound
    of ``row_idx (S, K)``). No host sync. ``q_norm_eps`` / ``rope = (cos, sin)`` (``(S, R/2)``,
    row ``i`` for query ``i``): ``q`` is the raw projection; the kernel applies the head RMS norm
    and RoPE as it loads it and un-rotates its output (``fused.norm_rope`` twice, folded in);
    ``fold_q``/``rope_out`` as ``decode_attention`` takes them; ``tuning``: the launch (None: below)."""
    if not use_triton(q):
        return prefill_attention_reference(
            q, keys, pad, sinks, window, rows, row_len, row_idx, scale, q_norm_eps=q_norm_eps, rope=rope, fold_q=fold_q, rope_out=rope_out
        )  # fmt: skip
    fold = {"q_norm_eps": q_norm_eps, "rope": rope, "fold_q": fold_q, "rope_out": rope_out}
    from kernels.decode_attention import decode_attention

    s = q.shape[0]
    assert keys.shape[0] == window - 1 + s and keys.stride(-1) == 1
    win = keys.unfold(0, window, 1).transpose(1, 2)  # (S, W, D) view: win[i, j] = keys[i + j]
    i = torch.arange(s, device=q.device, dtype=torch.int32)
    slot = torch.clamp(i, min=pad)  # first real key of query i
    swa_len = i + window - slot
    ws_rows = rows is not None and rows.shape[0] > 0
    folded_q = fold_q and (q_norm_eps is not None or rope is not None)  # q normed/rotated in the kernel
    if tuning is None and not folded_q and (not ws_rows or row_idx is not None) and ws_supported(q, keys, rows):
        # Hopper, bf16, 64 × 512 heads: the warp-specialised kernel (its module docstring), then
        # the inverse RoPE of the output as the Triton kernel's epilogue does it
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = prefill_attention_ws(q, keys, slot, swa_len, window, sinks, scale, rows, row_len, row_idx)
        return out if rope is None or not rope_out else rope_inplace(out, rope[0], -rope[1])
    tune = asdict(tuning) if tuning is not None else {}
    if not tune and q.dtype != torch.float32 and q.shape[1] >= 64:
        # all 64 heads of a query per program (each key tile loaded once per query, M=64 dots):
        # 8K prefill 70.1 ms against 74.5 with the decode default (16 heads, 4 warps), run 7;
        # 64 keys per tile and 2 stages: 61.0–63.1 ms against 63.2–65.9 with 32 keys, 1 stage (run 8,
        # four pairs of variants in two calls)
        tune = {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}
    has_rows = rows is not None and rows.shape[0] > 0
    if has_rows:
        row_start = torch.zeros(s, dtype=torch.int32, device=q.device)
        row_len = row_len.to(torch.int32)
        return decode_attention(
            q, win, swa_len, sinks, rows, row_start, row_len, row_idx, swa_slot=slot, scale=scale,
            max_rows=rows.shape[0], **fold, **tune,
        )  # fmt: skip
    return decode_attention(q, win, swa_len, sinks, swa_slot=slot, scale=scale, **fold, **tune)


# ---- indexer top-k ------------------------------------------------------------------------------
def prefill_topk_reference(
    q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, row_len: torch.Tensor, k: int, scale: float
) -> torch.Tensor:
    """Scores as ``Indexer.scores`` (fp32), future rows at -inf, ``torch.topk``; ``-1`` where the
    picked row is not visible. ``q (S, Hi, Di)``, ``weights (S, Hi)``, ``rows (T, Di)`` → ``(S, min(k, T))`` int32."""
    t = rows.shape[0]
    logits = torch.matmul(q.float(), rows.float().t())  # (S, Hi, T)
    scores = (logits.relu() * weights.float().unsqueeze(-1)).sum(dim=-2) * scale
    future = torch.arange(t, device=q.device)[None, :] >= row_len[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    vals, idx = scores.topk(min(k, t), dim=-1)
    return torch.where(vals == float("-inf"), -1, idx).to(torch.int32)


def prefill_topk(
    q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, row_len: torch.Tensor, k: int, scale: float,
    tuning: IndexerTuning = PREFILL.indexer,
) -> torch.Tensor:
    """Each query's top-``k`` visible indexer rows (local indices, ``-1`` = none). → ``(S, min(k, T))`` int32."""
    if not use_triton(q):
        return prefill_topk_reference(q, weights, rows, row_len, k, scale)
    from kernels.indexer import indexer_scores_prefill, mask_topk

    s, t = q.shape[0], rows.shape[0]
    row_len = row_len.to(torch.int32)
    out = torch.empty(s, min(k, t), dtype=torch.int32, device=q.device)
    launch = {"block_q": tuning.block_q, "block_t": tuning.block_t, "num_warps": tuning.num_warps}
    for a in range(0, s, tuning.query_tile):
        b = min(a + tuning.query_tile, s)
        scores = indexer_scores_prefill(q[a:b], weights[a:b], rows, row_len[a:b], scale, t, **launch)
        out[a:b] = mask_topk(scores, k, ordered=False)
    return out


# ---- mHC input ----------------------------------------------------------------------------------
def hc_pre_parts_reference(streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """``(N, 1, MP)`` fp32: ``fn @ x`` in columns ``[:M]``, ``Σ x²`` in column ``M`` (x = fp32 streams)."""
    n = streams.shape[0]
    m = fn.shape[0]
    x = streams.reshape(n, -1).float()
    parts = torch.zeros(n, 1, max(16, next_pow2(m + 1)), dtype=torch.float32, device=streams.device)
    parts[:, 0, :m] = x @ fn.float().t()
    parts[:, 0, m] = (x * x).sum(dim=-1)
    return parts


def hc_pre_block_parts(
    streams: torch.Tensor, fn: torch.Tensor, *, splits: int | None = None, fn3: torch.Tensor | None = None,
    tuning: HcPreTuning = PREFILL.hc_pre,
) -> torch.Tensor:  # fmt: skip
    """The partial sums ``kernels.mhc.hc_mix_parts`` takes, for many tokens: ``(N, S, MP)`` fp32,
    per split of the ``hc·H`` axis ``fn @ x`` (columns ``[:M]``) and ``Σ x²`` (column ``M``);
    one program per ``tuning.block_m`` tokens and split, ``fn`` read once per program. bf16 streams
    (``tuning.bf16x3``) take ``fn`` as ``split_bf16x3(fn)`` (``fn3``, computed if not given)."""
    if not use_triton(streams):
        return hc_pre_parts_reference(streams, fn)
    split3 = streams.dtype == torch.bfloat16 and tuning.bf16x3
    block_m, block_k = tuning.block_m, tuning.block_k
    n = streams.shape[0]
    x = streams.reshape(n, -1)
    assert x.stride(-1) == 1 and fn.is_contiguous() and fn.dtype == torch.float32
    k = x.shape[1]
    m = fn.shape[0]
    mp = max(16, next_pow2(m + 1))
    nb = triton.cdiv(max(n, 1), block_m)
    if splits is None:  # programs_per_sm programs per SM, at most 8 splits (hc_mix_parts adds them serially)
        from kernels._common import num_sms

        splits = max(1, min(8, triton.cdiv(tuning.programs_per_sm * num_sms(streams.device), nb)))
    per = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, per)
    parts = torch.empty(n, splits, mp, dtype=torch.float32, device=streams.device)
    if n:
        try:
            _hc_pre_block_kernel[(nb, splits)](
                x, (fn3 if fn3 is not None else split_bf16x3(fn)) if split3 else fn, parts, n, k, m, x.stride(0), per, MP=mp, BM=block_m, BK=block_k,
                PRECISION=dot_precision(torch.bfloat16) if split3 else tuning.precision, SPLIT3=split3,
                num_warps=tuning.num_warps, num_stages=tuning.num_stages,
            )  # fmt: skip
        except Exception:  # a Triton build without tf32x3: exact fp32 FMA dots instead
            if tuning.precision == "ieee":
                raise
            return hc_pre_block_parts(streams, fn, splits=splits, fn3=fn3, tuning=replace(tuning, precision="ieee"))
    return parts


def split_bf16x3(fn: torch.Tensor) -> torch.Tensor:
    """fp32 ``fn (M, K)`` as three bf16 terms ``(3, M, K)``, ``hi + mid + lo`` = ``fn`` to fp32's 24
    bits (8 each): bf16 streams times each term are exact fp32 products, so three bf16 tensor-core
    dots with fp32 accumulation give the fp32 dot."""
    hi = fn.to(torch.bfloat16)
    rest = fn - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)]).contiguous()


def hc_pre_norm(hc, norm, streams: torch.Tensor, tuning: HcPreTuning = PREFILL.hc_pre) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``post, comb, norm(collapse(pre, streams))`` of ``HyperConnection`` ``hc`` and the block's
    ``RMSNorm`` ``norm`` (Triton; the caller checks ``use_triton``)."""
    from kernels.fused import collapse_norm
    from kernels.mhc import hc_mix_parts

    fn = hc.fn.float().contiguous()
    fn3 = None
    if streams.dtype == torch.bfloat16:  # the bf16 terms of fn, kept on the module until fn changes
        # an inference tensor (weights made under inference_mode) has no version counter and cannot change in place
        key = (hc.fn.data_ptr(), 0 if hc.fn.is_inference() else hc.fn._version)
        cached = getattr(hc, "_fn_bf16x3", None)
        if cached is None or cached[0] != key:
            cached = hc._fn_bf16x3 = (key, split_bf16x3(fn))
        fn3 = cached[1]
    parts = hc_pre_block_parts(streams, fn, fn3=fn3, tuning=tuning)
    pre, post, comb = hc_mix_parts(
        parts, streams.shape[1] * streams.shape[2], hc.norm_eps, hc.scale, hc.base, hc.hc, hc.iters, hc.hc_eps
    )
    return post, comb, collapse_norm(pre, streams.contiguous(), norm.weight, norm.eps)


if HAS_TRITON:

    @triton.jit
    def _hc_pre_block_kernel(
        x_ptr, fn_ptr, part_ptr, N, K, M, stride_x, PER,
        MP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, SPLIT3: tl.constexpr = False,
    ):  # fmt: skip
        pid = tl.program_id(0)
        s = tl.program_id(1)
        splits = tl.num_programs(1)
        rows = pid * BM + tl.arange(0, BM)
        r_ok = rows < N
        m = tl.arange(0, MP)
        m_ok = m < M
        acc = tl.zeros((BM, MP), tl.float32)
        sq = tl.zeros((BM,), tl.float32)
        k0 = s * PER
        for kk in range(0, PER, BK):
            k = k0 + kk + tl.arange(0, BK)
            k_ok = k < K
            xr = tl.load(
                x_ptr + rows.to(tl.int64)[:, None] * stride_x + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0
            )  # (BM, BK)
            x = xr.to(tl.float32)
            w_ptrs = fn_ptr + m[None, :] * K + k[:, None]
            w_ok = m_ok[None, :] & k_ok[:, None]
            if SPLIT3:  # bf16 x times the three bf16 terms of fn: exact products, fp32 sums
                acc += mma(xr, tl.load(w_ptrs, mask=w_ok, other=0.0), PRECISION)
                acc += mma(xr, tl.load(w_ptrs + M * K, mask=w_ok, other=0.0), PRECISION)
                acc += mma(xr, tl.load(w_ptrs + 2 * M * K, mask=w_ok, other=0.0), PRECISION)
            else:
                w = tl.load(w_ptrs, mask=w_ok, other=0.0)  # (BK, MP)
                acc += tl.dot(x, w, input_precision=PRECISION)
            sq += tl.sum(x * x, axis=1)
        res = tl.where(m[None, :] == M, sq[:, None], acc)
        ptrs = part_ptr + (rows.to(tl.int64)[:, None] * splits + s) * MP + m[None, :]
        tl.store(ptrs, res, mask=r_ok[:, None])


__all__ = [
    "hc_pre_block_parts",
    "hc_pre_norm",
    "hc_pre_parts_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "prefill_topk",
    "prefill_topk_reference",
]
