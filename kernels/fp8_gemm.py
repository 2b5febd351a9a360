"""Block-scaled FP8 GEMM: ``y = x · Wᵀ`` with DeepSeek's FP8 checkpoint format, bf16 out.

Weights: ``wq (N, K)`` float8 e4m3 with one power-of-two (ue8m0) scale per 128×128 block, ``ws
(⌈N/128⌉, ⌈K/128⌉)`` fp32 here (the checkpoint stores the exponent byte, float8_e8m0fnu;
``scales_to_fp32`` widens it once at load). Activations: quantised on the fly per row and
128-column group, as DeepSeek's inference does (``act_quant`` with ``scale_fmt="ue8m0"``): the
group's scale is the smallest power of two ``2^e`` with ``448·2^e ≥ amax`` (amax clamped to 1e-4),
so ``x / 2^e`` is exact and fits e4m3 without saturating. Hence::

    y[m, n] = Σ_kb  sx[m, kb] · sw[n // 128, kb] · Σ_{k in block kb} qx[m, k] · qw[n, k]

The inner sum is one FP8 tensor-core product per 128-wide K block, promoted to fp32 registers and
scaled there (the per-block promotion DeepSeek-V3's report describes). Every scale is a power of
two and e4m3 products are exact in fp32, so the only roundings are the activation's e4m3 rounding,
the fp32 accumulation and the final bf16 cast: ``fp8_linear_reference`` (dequantise both sides,
fp32 matmul) is the same function up to fp32 summation order.

Two tilings (``Fp8GemmConfig.tiles``): few rows (decode, M ≤ ``small_m``) is a weight stream —
narrow N tiles split over K so that every SM pulls weight bytes, fp32 atomics into a zeroed
buffer; many rows (prefill) is a compute tile ``(BM, BN)`` with grouped program order for L2
reuse. The activations are quantised inside the GEMM (``fuse_quant``: no extra pass, each N tile
re-quantises its rows) or by ``quantize_act`` first (one pass, read once by every N tile).
``K`` and ``N`` need not be multiples of 128: loads are masked and the scale grids rounded up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels._common import HAS_TRITON, INTERPRET, dot_precision, mma, num_sms, tl, triton, use_triton

BLOCK = 128  # the checkpoint's scale block (both axes of the weight, K of the activations)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-4  # DeepSeek's act_quant clamp: an all-zero group still gets a finite scale


# ---- scales and quantisation (PyTorch references) -------------------------------------------------
def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``2^e`` with ``448·2^e ≥ amax`` (fp32, exact): with ``amax = f·2^q``,
    ``f ∈ [0.5, 1)``, that is ``e = q − 9 + (f > 0.875)`` (448 = 0.875·2^9)."""
    f, q = torch.frexp(amax.float())
    return torch.ldexp(torch.ones_like(f), q - 9 + (f > 0.875).to(q.dtype))


def quantize_act_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (M, K)`` → e4m3 ``(M, K)`` and fp32 scales ``(M, ⌈K/128⌉)`` (per row and 128-column group)."""
    m, k = x.shape
    kb = -(-k // BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).view(m, kb, BLOCK)
    scale = ue8m0_scale(xf.abs().amax(-1).clamp(min=AMAX_MIN))  # (M, KB)
    q = (xf / scale[..., None]).to(FP8).view(m, kb * BLOCK)[:, :k]
    return q.contiguous(), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (N, K)`` → e4m3 ``(N, K)`` and float8_e8m0fnu scales ``(⌈N/128⌉, ⌈K/128⌉)``, one ue8m0 scale
    per 128×128 block (the released checkpoints' format; all-zero blocks get the AMAX_MIN scale)."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    wf = torch.nn.functional.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n)).view(nb, BLOCK, kb, BLOCK)
    scale = ue8m0_scale(wf.abs().amax(dim=(1, 3)).clamp(min=AMAX_MIN))  # (NB, KB)
    q = (wf / scale[:, None, :, None]).to(FP8).view(nb * BLOCK, kb * BLOCK)[:n, :k]
    return q.contiguous(), scale.to(torch.float8_e8m0fnu)


def scales_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's block scales (float8_e8m0fnu, exponent bytes as uint8, or float) as fp32."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float().contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q (N, K)`` e4m3 times its block scales → fp32 ``(N, K)``."""
    n, k = q.shape
    s = scales_to_fp32(scale).repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return q.float() * s


def fp8_linear_reference(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``fp8_linear`` in PyTorch: quantise ``x (M, K)`` per group, dequantise both sides, fp32 matmul."""
    xq, xs = quantize_act_reference(x)
    xd = (xq.float().view(x.shape[0], -1) * xs.repeat_interleave(BLOCK, 1)[:, : x.shape[1]])  # (M, K)
    return (xd @ dequantize_weight(wq, ws).t()).to(out_dtype or x.dtype)


# ---- tiling ----------------------------------------------------------------------------------------
class Tiles(NamedTuple):
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    fuse_quant: bool
    fold_scales: bool


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile choice by row count. Defaults: the fastest of ``bench/fp8_gemm_bench.py``'s sweep on an
    H200 (run 2, ``bench/results_recorded/fp8_gemm_h200_run2.json``; docs/PERFORMANCE.md)."""

    small_m: int = 64  # M ≤ this: the weight-streaming tiling
    small_block_n: int = 64
    small_programs_per_sm: int = 2  # split K until about this many programs per SM
    small_stages: int = 4
    large_block_m: int = 64  # run 2: 64×128 with 4 warps beat 128×128 with 8 by 10-15%
    large_block_n: int = 128
    large_warps: int = 4
    stages: int = 4  # of the large tiling (5 was 30-50% slower, 3 about 5%)
    # quantise inside the GEMM up to this M, else one quantize_act pass first (run 1: the separate
    # pass was faster from M=1 on the large projections, 12.5 vs 15.0 µs for wq_b at M=1)
    fuse_quant_max_m: int = 0
    # one FMA per accumulator element (sa·sb first, the weight scale a scalar when BN divides 128)
    # instead of two multiplies (run 2: 6-12% faster at M=8192); a product sa·sb below 2^-126 would
    # be flushed to zero if the compiler flushed subnormals (it did not: the exact test at 2^-133 passed)
    fold_scales: bool = True

    def tiles(self, m: int, n: int, k: int, sms: int) -> Tiles:
        fuse = m <= self.fuse_quant_max_m
        if m <= self.small_m:
            bm = max(16, triton.next_power_of_2(m)) if HAS_TRITON else 16
            bn = self.small_block_n
            n_tiles, k_blocks = -(-n // bn), -(-k // BLOCK)
            split = max(1, min(k_blocks, self.small_programs_per_sm * sms // n_tiles))
            return Tiles(bm, bn, split, 4, self.small_stages, fuse, self.fold_scales)
        return Tiles(self.large_block_m, self.large_block_n, 1, self.large_warps, self.stages, fuse, self.fold_scales)


DEFAULT = Fp8GemmConfig()


# ---- kernels ---------------------------------------------------------------------------------------
def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_reference`` as one Triton pass (bitwise the same values)."""
    if not use_triton(x):
        return quantize_act_reference(x)
    m, k = x.shape
    kb = triton.cdiv(k, BLOCK)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    bm = 16
    _quant_act_kernel[(triton.cdiv(m, bm), kb)](x, q, s, m, k, kb, BM=bm, BK=BLOCK, num_warps=4)
    return q, s


def fp8_linear(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, config: Fp8GemmConfig = DEFAULT, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x (M, K)`` (bf16/fp16/fp32) times the block-scaled FP8 weight ``wq (N, K)``, ``ws`` fp32
    ``(⌈N/128⌉, ⌈K/128⌉)`` → ``(M, N)`` in ``out_dtype`` (default ``x.dtype``); see the module docstring."""
    m, k = x.shape
    n, k2 = wq.shape
    assert k == k2 and wq.dtype == FP8 and ws.dtype == torch.float32, "fp8_linear: wq e4m3 (N, K), ws fp32"
    assert ws.shape == (-(-n // BLOCK), -(-k // BLOCK)), f"fp8_linear: scale grid {tuple(ws.shape)} for ({n}, {k})"
    out_dtype = out_dtype or x.dtype
    if not use_triton(x):
        return fp8_linear_reference(x, wq, ws, out_dtype)
    x, wq, ws = x.contiguous(), wq.contiguous(), ws.contiguous()
    t = config.tiles(m, n, k, num_sms(x.device))
    if t.fuse_quant:
        xa, xs = x, x  # xs unused
    else:
        xa, xs = quantize_act(x)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if t.split_k > 1 else torch.empty(m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), t.split_k)
    _fp8_gemm_kernel[grid](
        xa, xs, wq, ws, out, m, n, k, triton.cdiv(k, BLOCK),
        BM=t.block_m, BN=t.block_n, BK=BLOCK, SPLIT_K=t.split_k, QUANT_A=t.fuse_quant, GROUP_M=8,
        FOLD=t.fold_scales and BLOCK % t.block_n == 0,
        PRECISION=dot_precision(torch.bfloat16), num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out.to(out_dtype) if t.split_k > 1 else out


if HAS_TRITON:
    # Triton 3.9's interpreter rounds fp32 → e4m3 wrongly (31.0 → 16.0; ties away from zero): there
    # the tile is rounded to the e4m3 grid first (round-half-even, as the GPU's cvt.rn does), so the
    # cast only meets representable values. Compiled for the GPU this is a no-op.
    _ROUND_FIRST = tl.constexpr(INTERPRET)

    @triton.jit
    def _round_e4m3(v):
        """``v`` (fp32, |v| ≤ 448) rounded half-even to e4m3's grid: step ``2^(e−3)`` for
        ``|v| ∈ [2^e, 2^(e+1))``, ``2^-9`` below ``2^-6`` (subnormals), by adding and removing
        ``1.5·2^(e+20)``."""
        e = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # biased exponent
        magic = (((e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
        return (v + magic) - magic

    @triton.jit
    def _group_scale(amax):
        """``ue8m0_scale`` on the exponent bits (exact): → (scale, 1 / scale), fp32, ``amax > 0``."""
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        return scale, inv

    @triton.jit
    def _quantize_tile(a):
        """A ``(BM, BK)`` tile of one 128-column group → e4m3 tile and its per-row scales ``(BM,)``."""
        af = a.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(af), axis=1), 1e-4)  # AMAX_MIN
        scale, inv = _group_scale(amax)
        v = af * inv[:, None]
        if _ROUND_FIRST:
            v = _round_e4m3(v)
        return v.to(tl.float8e4nv), scale

    @triton.jit
    def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, KB, BM: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        kb = tl.program_id(1)
        cols = kb * BK + tl.arange(0, BK)
        ok = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        q, scale = _quantize_tile(tl.load(x_ptr + offs, mask=ok, other=0.0))
        tl.store(q_ptr + offs, q, mask=ok)
        tl.store(s_ptr + rows * KB + kb, scale, mask=rows < M)

    @triton.jit
    def _fp8_gemm_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, KB,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, QUANT_A: tl.constexpr,
        GROUP_M: tl.constexpr, FOLD: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        per_group = GROUP_M * num_n  # programs of GROUP_M row tiles: they share weight tiles in L2
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        r_ok = rows < M
        c_ok = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
        ws_cols = ws_ptr + (cols // BK) * KB  # (BN,) each column's row of block scales
        per_split = tl.cdiv(KB, SPLIT_K)
        kb0 = tl.program_id(1) * per_split
        kb1 = tl.minimum(kb0 + per_split, KB)
        acc = tl.zeros((BM, BN), tl.float32)
        for kb in range(kb0, kb1):
            kk = kb * BK + tl.arange(0, BK)
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
            if QUANT_A:
                a, sa = _quantize_tile(a)
            else:
                sa = tl.load(xs_ptr + rows * KB + kb, mask=r_ok, other=0.0)
            b = tl.load(w_cols + kk[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0.0)  # (BK, BN) e4m3
            if FOLD:  # BN divides 128: the tile's one weight scale of this K block
                sb = tl.load(ws_ptr + (pid_n * BN // BK) * KB + kb)
                acc += mma(a, b, PRECISION) * (sa * sb)[:, None]
            else:  # the row scale first: sa·sb of two small scales could be subnormal (flushed to zero)
                sb = tl.load(ws_cols + kb, mask=c_ok, other=0.0)  # (BN,)
                acc += (mma(a, b, PRECISION) * sa[:, None]) * sb[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        ok = r_ok[:, None] & c_ok[None, :]
        if SPLIT_K > 1:
            tl.atomic_add(out_ptr + offs, acc, mask=ok, sem="relaxed")
        else:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


__all__ = [
    "DEFAULT",
    "Fp8GemmConfig",
    "dequantize_weight",
    "fp8_linear",
    "fp8_linear_reference",
    "quantize_act",
    "quantize_act_reference",
    "quantize_weight",
    "scales_to_fp32",
    "ue8m0_scale",
]
