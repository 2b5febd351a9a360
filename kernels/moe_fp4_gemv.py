"""Routed FP4 experts for a few tokens: two weight-streaming GEMV kernels that decode e2m1 in registers.

``kernels.moe_gemv``'s two-kernel form (decode batch 1-2: ``n·k ≤ 16`` slots against as many
experts) over the checkpoint's FP4 experts (``kernels.moe_fp4``'s layout: ``wq (E, N, K/2)`` two
e2m1 codes a byte, low nibble first, ``ws (E, N, K/32)`` e8m0)::

    act[s] = swiglu(x[t] @ dequant(gate_up[e])ᵀ)   one program per (slot s = (token t, pick j), BI
                                                  of I): BI gate and BI up rows, packed bytes +
                                                  scales streamed once, decoded to fp32 (exact)
    out[t] = Σ_j w[t, j] · act[s] @ dequant(down[e])ᵀ   one program per (token, BH of H)

A quarter of bf16's weight bytes (plus 1/32 for scales) at the same access pattern; the grouped
kernel (``moe_fp4``) pads each slot to a 16-row tensor-core tile instead. Roundings as
``moe_experts_fp4``: the gate/up and down products rounded to the input dtype, the weighted sum
in fp32 and rounded once. ``N`` and ``K`` of both weights must be multiples of the K tile.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, tl, triton, use_triton
from kernels.moe import _RND
from kernels.moe_fp4 import GROUP, moe_experts_fp4
from kernels.moe_gemv import MOE_GEMV, MoEGemvTuning, resolved


def moe_fp4_gemv(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, gate_up_q: torch.Tensor, gate_up_s: torch.Tensor,
    down_q: torch.Tensor, down_s: torch.Tensor, limit: float, tuning: MoEGemvTuning = MOE_GEMV,
) -> torch.Tensor:  # fmt: skip
    """``x (N, H)``, ``weights (N, k)`` fp32, ``indices (N, k)``, FP4 experts ``gate_up (E, 2I, H/2)``
    / ``down (E, H, I/2)`` with their e8m0 scales → routed sum ``(N, H)`` (module docstring);
    ``moe_experts_fp4`` where Triton cannot run. No host sync."""
    if not use_triton(x):
        return moe_experts_fp4(x, weights, indices, gate_up_q, gate_up_s, down_q, down_s, limit)
    n, hidden = x.shape
    k = indices.shape[1]
    inter = gate_up_q.shape[1] // 2
    assert gate_up_q.shape[2] * 2 == hidden and down_q.shape[1:] == (hidden, inter // 2), "moe_fp4_gemv: shapes"
    x, idx, w = x.contiguous(), indices.contiguous(), weights.contiguous()
    gq, gs, dq, ds = (t.contiguous().view(torch.uint8) for t in (gate_up_q, gate_up_s, down_q, down_s))
    out = torch.empty_like(x)
    if n == 0:
        return out
    act = torch.empty(n * k, inter, dtype=x.dtype, device=x.device)
    bi, bk, warps = resolved(tuning.up, hidden)
    bk = min(bk, triton.next_power_of_2(hidden))
    assert hidden % bk == 0 and inter % bi == 0, "moe_fp4_gemv: H a multiple of the K tile, I of the row tile"
    _fp4_up_kernel[(n * k, inter // bi)](
        x, idx, gq.view(torch.int32), gs, act, hidden, inter, float(limit), K=k, BI=bi, BK=bk, G=GROUP, RND=_RND.get(x.dtype, 0), num_warps=warps,
    )  # fmt: skip
    bh, bk, warps = resolved(tuning.down, inter)
    bk = min(bk, triton.next_power_of_2(inter))
    assert inter % bk == 0 and hidden % bh == 0, "moe_fp4_gemv: I a multiple of the K tile, H of the row tile"
    _fp4_down_kernel[(n, hidden // bh)](
        act, idx, w, dq.view(torch.int32), ds, out, hidden, inter, K=k, BH=bh, BK=bk, G=GROUP, RND=_RND.get(x.dtype, 0), num_warps=warps,
    )  # fmt: skip
    return out


if HAS_TRITON:
    from kernels.moe import _round_to
    from kernels.moe_fp4 import _fp4_rows_dot

    @triton.jit
    def _fp4_up_kernel(
        x_ptr, idx_ptr, w_ptr, s_ptr, act_ptr, H, I, limit,
        K: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, RND: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)  # slot = token · K + pick
        t = s // K
        e = tl.load(idx_ptr + s).to(tl.int64)
        w_base = w_ptr + e * (2 * I) * (H // 8)
        s_base = s_ptr + e * (2 * I) * (H // G)
        rows = tl.program_id(1) * BI + tl.arange(0, BI)
        x_row = x_ptr + t.to(tl.int64) * H
        acc_g = tl.zeros([BI, BK // 8], dtype=tl.float32)
        acc_u = tl.zeros([BI, BK // 8], dtype=tl.float32)
        for k0 in range(0, H, BK):
            acc_g += _fp4_rows_dot(w_base, s_base, rows, k0, H, x_row, BI, BK, G)
            acc_u += _fp4_rows_dot(w_base, s_base, rows + I, k0, H, x_row, BI, BK, G)
        gate = tl.minimum(_round_to(tl.sum(acc_g, axis=1), RND), limit)
        up = tl.minimum(tl.maximum(_round_to(tl.sum(acc_u, axis=1), RND), -limit), limit)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + s.to(tl.int64) * I + rows, act.to(act_ptr.dtype.element_ty))

    @triton.jit
    def _fp4_down_kernel(
        act_ptr, idx_ptr, w_ptr, dq_ptr, ds_ptr, out_ptr, H, I,
        K: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, RND: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        rows = tl.program_id(1) * BH + tl.arange(0, BH)
        total = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(K):
            e = tl.load(idx_ptr + t * K + j).to(tl.int64)
            wj = tl.load(w_ptr + t * K + j).to(tl.float32)
            w_base = dq_ptr + e * H * (I // 8)
            s_base = ds_ptr + e * H * (I // G)
            a_row = act_ptr + (t * K + j).to(tl.int64) * I
            acc = tl.zeros([BH, BK // 8], dtype=tl.float32)
            for k0 in range(0, I, BK):
                acc += _fp4_rows_dot(w_base, s_base, rows, k0, I, a_row, BH, BK, G)
            total += wj * _round_to(tl.sum(acc, axis=1), RND)
        tl.store(out_ptr + t.to(tl.int64) * H + rows, total.to(out_ptr.dtype.element_ty))


__all__ = ["moe_fp4_gemv"]
