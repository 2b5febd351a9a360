"""Dense projections of one token: a weight-streaming GEMV kernel.

At decode batch 1 a projection ``y = x @ Wᵀ`` reads ``W (N, K)`` once and does two FLOPs per
weight element: it is a pure weight stream. cuBLAS (``F.linear``) runs these as small-tile GEMMs,
several with a split-K reduce kernel behind them, at ~2.2-3.5 TB/s on an H200 (NOTES run 14: the
q_b/o_a/o_b projections 19-21 µs for 64 MB, the merged x projection ~9.7 µs for 21 MB, the 2 MB
router 5.5 µs). Here one program takes ``BN`` rows of ``W`` and streams them in ``(BN, BK)`` tiles
(16-byte loads along ``K``), fp32 accumulators, one rounding to the output dtype — no split, no
reduce kernel::

    y[0, r] = Σ_k x[0, g(r)·K + k] · W[r, k]        g(r) = r // (N / groups)

``groups > 1`` is the block-diagonal grouped projection (``GroupedLinear``, the attention's
``o_a``): the ``N / groups`` rows of group ``g`` read columns ``[g·K, (g+1)·K)`` of ``x``, and
``y`` comes out as the flat ``(1, N)`` the next projection reads. ``out_dtype=torch.float32``
writes the product rounded to ``x``'s dtype as fp32 (``F.linear(x, W).float()`` in one kernel:
the lm_head's logits). With ``pdl`` (the default) the kernel is a programmatic dependent launch: it starts under
the previous kernel's tail and streams its first weight tile before it waits for that kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import HAS_TRITON, INTERPRET, even_tile, tl, triton, use_triton
from kernels.moe import _RND


# One token only: a second token's accumulators in the same program (117 registers, half the
# programs per SM) lost to cuBLAS on q_b and the lm_head and made the b=2 step 26 µs slower (run 14).


def use_gemv(x: torch.Tensor) -> bool:
    """Whether ``gemv`` should run the projection of ``x (T, ·)``: one token, Triton available."""
    return use_triton(x) and x.shape[0] == 1


def config(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program BN, K tile BK, num_warps) for ``W (n, k)``; the microbench
    (``python -m bench.gemv_sweep``) sweeps them."""
    bk = min(1024, triton.next_power_of_2(k)) if HAS_TRITON else 1024
    if n <= 512:  # the router: few rows, keep enough programs in flight
        return 1, min(2048, bk * 2), 4
    return 4, even_tile(k, bk), 4


def gemv_reference(x: torch.Tensor, w: torch.Tensor, groups: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x (T, groups·K)``, ``w (N, K)`` → ``(T, N)`` (module docstring), through PyTorch."""
    if groups == 1:
        y = F.linear(x, w)
    else:
        t = x.shape[0]
        xg = x.reshape(t, groups, -1).transpose(0, 1)  # (G, T, K)
        y = torch.bmm(xg, w.view(groups, -1, w.shape[1]).transpose(1, 2)).transpose(0, 1).reshape(t, -1)
    return y if out_dtype is None else y.to(out_dtype)


def gemv(
    x: torch.Tensor, w: torch.Tensor, groups: int = 1, out_dtype: torch.dtype | None = None,
    cfg: tuple[int, int, int] | None = None, pdl: bool = True, round_to_x: bool = True,
) -> torch.Tensor:  # fmt: skip
    """``x (T, groups·K)``, ``w (N, K)`` → ``(T, N)`` in ``out_dtype`` (default ``x``'s); the
    reference where Triton cannot run, for other than one token, a strided ``w`` or ``x``.

    ``pdl``: a programmatic dependent launch: the kernel may start while the previous kernel in
    the stream (or CUDA graph) still runs; it loads its first weight tile (no dependency), then
    waits for that kernel (``gdc_wait``) before reading ``x`` or writing ``y``; b=1 step −12 to
    −16 µs (NOTES run 14). ``round_to_x`` False (with ``out_dtype`` fp32): the fp32 sum of the
    products of ``x``'s and ``w``'s values unrounded, ``F.linear(x.float(), w.float())`` without
    widening ``x`` first."""
    if not use_triton(x) or x.shape[0] != 1 or not w.is_contiguous() or x.stride(-1) != 1:
        if not round_to_x:
            return gemv_reference(x.float(), w.float(), groups, out_dtype)
        return gemv_reference(x, w, groups, out_dtype)
    n, k = w.shape
    assert x.shape[1] == groups * k and n % groups == 0
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    bn, bk, warps = cfg or config(n, k)
    rpg = n // groups
    assert groups == 1 or rpg % bn == 0, "a program's rows must lie in one group"
    pdl = pdl and not INTERPRET
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, out, n, k, rpg,
        BN=bn, BK=bk, EVEN=(n % bn == 0 and k % bk == 0), RND=_RND.get(x.dtype, 0) if round_to_x else 0, PDL=pdl,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


if HAS_TRITON:
    from kernels._common import gdc_wait, launch_dependents
    from kernels.moe import _round_to

    @triton.jit
    def _load_w(w_rows, c, r_ok, K, EVEN: tl.constexpr):
        if EVEN:
            return tl.load(w_rows + c[None, :])
        return tl.load(w_rows + c[None, :], mask=r_ok[:, None] & (c < K)[None, :], other=0.0)

    @triton.jit
    def _load_x(x_row, c, K, EVEN: tl.constexpr):
        if EVEN:
            xv = tl.load(x_row + c)
        else:
            xv = tl.load(x_row + c, mask=c < K, other=0.0)
        return xv.to(tl.float32)[None, :]

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, y_ptr, N, K, RPG,
        BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, RND: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # the next kernel (if launched as a dependent) may start once every program is here
            launch_dependents()
        r0 = tl.program_id(0) * BN
        rows = r0 + tl.arange(0, BN)
        r_ok = rows < N
        cols = tl.arange(0, BK)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        x0 = x_ptr + (r0 // RPG).to(tl.int64) * K  # this program's group's columns
        wt = _load_w(w_rows, cols, r_ok, K, EVEN)  # weights need nothing from the previous kernel
        if PDL:
            gdc_wait()
        # (tried in run 14 and slower per b=1 step: tile k+1's loads issued before tile k's FMAs,
        # 88 registers, +30 µs; each tile summed to (BN,) at once, 40 registers, +20 µs)
        acc = wt.to(tl.float32) * _load_x(x0, cols, K, EVEN)
        for k0 in range(BK, K, BK):
            acc += _load_w(w_rows, k0 + cols, r_ok, K, EVEN).to(tl.float32) * _load_x(x0, k0 + cols, K, EVEN)
        y = _round_to(tl.sum(acc, axis=1), RND)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=r_ok)
