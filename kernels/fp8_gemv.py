"""One token times a block-scaled FP8 weight: a weight-streaming GEMV that dequantises in registers.

At decode batch 1 an FP8 linear ``y = x · dequant(wq, ws)ᵀ`` (``kernels.fp8_gemm``'s format: ``wq
(N, K)`` e4m3, one power-of-two scale per 128×128 block in ``ws (⌈N/128⌉, ⌈K/128⌉)`` fp32) reads one
byte per weight and does two FLOPs on it: a pure weight stream, as ``kernels.gemv`` is for bf16.
The GEMM's streaming tiling still pads the one row to a 16-row tensor-core tile and splits K over
fp32 atomics into a zeroed buffer (two launches more: the zeroing and the activation pass).

Here one program takes ``BN`` rows (``BN`` divides 128, so they share one row of block scales) and
streams them in ``(BN, BK)`` tiles, ``BK`` a multiple of 128. The activation is quantised as the
GEMM quantises it (``quantize_act``: per 128-column group, ue8m0 scale, e4m3 codes), inside every
program from the same values, so batch 1 and batch ``M`` compute the same function::

    y[0, n] = Σ_k  (qx[k] · sx[k // 128] · sw[n // 128, k // 128]) · qw[n, k]

Every factor is a power of two or an e4m3 value, so each product is exact in fp32 and the result
equals ``fp8_linear_reference`` up to the fp32 summation order (bitwise on integer-exact inputs).
``groups > 1`` is the block-diagonal grouped projection (``kernels.gemv``'s meaning: rows of group
``g`` read columns ``[g·K, (g+1)·K)`` of ``x``; each group's columns quantised on their own).
``pdl``: a programmatic dependent launch, as ``kernels.gemv``.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, INTERPRET, tl, triton, use_triton
from kernels.fp8_gemm import BLOCK, FP8, fp8_linear_reference


def config(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program BN, K tile BK, num_warps) for ``wq (n, k)``: BK up to 1024 FP8 bytes a row."""
    bk = max(BLOCK, min(1024, triton.next_power_of_2(k))) if HAS_TRITON else 1024
    return (1 if n <= 512 else 4), bk, 4


def fp8_gemv_reference(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, groups: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``fp8_gemv`` in PyTorch: per group, ``fp8_linear_reference`` of its columns and rows."""
    if groups == 1:
        return fp8_linear_reference(x, wq, ws, out_dtype)
    t, n = x.shape[0], wq.shape[0]
    rpg, k = n // groups, wq.shape[1]
    nb = rpg // BLOCK
    ys = [fp8_linear_reference(x[:, g * k : (g + 1) * k], wq[g * rpg : (g + 1) * rpg], ws[g * nb : (g + 1) * nb], out_dtype) for g in range(groups)]
    return torch.cat(ys, dim=1).view(t, n)


def fp8_gemv(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, groups: int = 1, out_dtype: torch.dtype | None = None,
    cfg: tuple[int, int, int] | None = None, pdl: bool = True,
) -> torch.Tensor:  # fmt: skip
    """``x (1, groups·K)`` (bf16/fp16/fp32), ``wq (N, K)`` e4m3, ``ws`` fp32 ``(⌈N/128⌉, ⌈K/128⌉)``
    → ``(1, N)`` in ``out_dtype`` (default ``x``'s); the reference where Triton cannot run or for
    more than one row. ``groups > 1`` needs ``K`` and ``N / groups`` multiples of 128."""
    n, k = wq.shape
    assert wq.dtype == FP8 and ws.dtype == torch.float32 and ws.shape == (-(-n // BLOCK), -(-k // BLOCK)), "fp8_gemv: wq e4m3 (N, K), ws fp32 grid"
    assert x.shape[1] == groups * k and n % groups == 0, "fp8_gemv: x (T, groups·K)"
    assert groups == 1 or (k % BLOCK == 0 and (n // groups) % BLOCK == 0), "fp8_gemv: groups need 128-aligned K and rows per group"
    if not use_triton(x) or x.shape[0] != 1:
        return fp8_gemv_reference(x, wq, ws, groups, out_dtype)
    x, wq, ws = x.contiguous(), wq.contiguous(), ws.contiguous()
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    bn, bk, warps = cfg or config(n, k)
    assert BLOCK % bn == 0 and bk % BLOCK == 0, "fp8_gemv: BN divides 128, BK a multiple of 128"
    pdl = pdl and not INTERPRET
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, wq, ws, out, n, k, n // groups, triton.cdiv(k, BLOCK),
        BN=bn, BK=bk, EVEN=(n % bn == 0 and k % bk == 0), PDL=pdl,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


if HAS_TRITON:
    from kernels._common import gdc_wait, launch_dependents
    from kernels.fp8_gemm import _quantize_tile

    @triton.jit
    def _load_w(w_rows, c, r_ok, K, EVEN: tl.constexpr):
        if EVEN:
            return tl.load(w_rows + c[None, :])
        return tl.load(w_rows + c[None, :], mask=r_ok[:, None] & (c < K)[None, :], other=0.0)

    @triton.jit
    def _scaled_x(x_row, s_row, k0, K, KB, BK: tl.constexpr, EVEN: tl.constexpr):
        """Columns ``[k0, k0 + BK)`` (``k0`` 128-aligned) of the row, quantised per 128-group and
        dequantised with the weight's block scales folded in → ``(1, BK)`` fp32 (exact)."""
        c = k0 + tl.arange(0, BK)
        if EVEN:
            xv = tl.load(x_row + c)
        else:
            xv = tl.load(x_row + c, mask=c < K, other=0.0)
        q, sx = _quantize_tile(tl.reshape(xv, (BK // 128, 128)))  # (G, 128) e4m3, (G,) scales
        g = k0 // 128 + tl.arange(0, BK // 128)
        sw = tl.load(s_row + g, mask=g < KB, other=0.0)  # (G,) this row block's weight scales
        xd = (q.to(tl.float32) * sx[:, None]) * sw[:, None]  # the row scale first (no subnormal sx·sw)
        return tl.reshape(xd, (BK,))[None, :]

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, N, K, RPG, KB,
        BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            launch_dependents()
        r0 = tl.program_id(0) * BN
        rows = r0 + tl.arange(0, BN)
        r_ok = rows < N
        cols = tl.arange(0, BK)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        x0 = x_ptr + (r0 // RPG).to(tl.int64) * K  # this program's group's columns
        s_row = s_ptr + (r0 // 128) * KB  # BN divides 128: one row of block scales
        wt = _load_w(w_rows, cols, r_ok, K, EVEN)  # weights need nothing from the previous kernel
        if PDL:
            gdc_wait()
        acc = wt.to(tl.float32) * _scaled_x(x0, s_row, 0, K, KB, BK, EVEN)
        for k0 in range(BK, K, BK):
            acc += _load_w(w_rows, k0 + cols, r_ok, K, EVEN).to(tl.float32) * _scaled_x(x0, s_row, k0, K, KB, BK, EVEN)
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=r_ok)


__all__ = ["config", "fp8_gemv", "fp8_gemv_reference"]
