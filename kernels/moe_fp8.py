"""Routed experts with FP8 (e4m3) weights and 128×128 block scales, as DeepSeek's checkpoints
store them: a Triton grouped GEMM that streams each touched expert's FP8 weight tiles once.

At decode the MoE is weight-bandwidth-bound (run 4: 11.9 of 15.3 ms of the b=64 step read bf16
expert weights), so one byte per weight instead of two halves its floor. ``torch._scaled_mm``
rejects 128×128 weight block scales on the lent machine's torch (``../shared/GPU.md``), hence
this kernel. Layout: ``wq (E, N, K)`` float8_e4m3fn, ``ws (E, N/128, K/128)`` fp32, the weight
of block ``(i, j)`` being ``wq[e, i·128:(i+1)·128, j·128:(j+1)·128] · ws[e, i, j]``.

One program per (expert, 128-column tile): it returns at once when the expert has no rows (the
expert counts stay on the device: no host sync, CUDA-graph capturable), else walks its rows in
``BM``-row tiles and K in 128-wide blocks: ``acc += (x_tile @ dequant(w_tile)ᵀ) · scale`` with
the FP8 tile widened to bf16 in registers and fp32 accumulation. Activations stay bf16.
The rest (sorting, SwiGLU, weighted combine) is ``kernels.moe``'s.
"""

from __future__ import annotations

from collections.abc import Callable

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

BLOCK = 128  # the checkpoint's scale block
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (..., N, K)`` → e4m3 ``(..., N, K)`` and fp32 scales ``(..., N/128, K/128)`` (amax/448
    per block, as DeepSeek's FP8 checkpoints)."""
    *lead, n, k = w.shape
    assert n % BLOCK == 0 and k % BLOCK == 0, "FP8 block scales need multiples of 128"
    blocks = w.float().reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(*lead, n, k)
    return q, scale.reshape(*lead, n // BLOCK, k // BLOCK).contiguous()


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_blocks`` (the reference the kernel is tested against)."""
    s = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return (q.float() * s).to(dtype)


def fp8_grouped_linear(xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, *, block_m: int | None = None) -> torch.Tensor:
    """Rows ``xs (M, K)`` sorted by group (group ``g`` = rows ``[offs[g-1], offs[g])``, ``offs``
    int32 group ends) times ``dequant(wq[g], ws[g])ᵀ`` → ``(M, N)`` in ``xs.dtype``."""
    m, k = xs.shape
    e, n, k2 = wq.shape
    assert k == k2 and n % BLOCK == 0 and k % BLOCK == 0 and xs.is_contiguous() and wq.is_contiguous()
    out = torch.empty(m, n, dtype=xs.dtype, device=xs.device)
    if not use_triton(xs):
        return grouped_linear_reference(xs, wq, ws, offs, dequantize_blocks, out)
    if m == 0:
        return out
    if block_m is None:
        block_m = default_block_m(m, e)
    _fp8_grouped_kernel[(e, n // BLOCK)](
        xs, wq, ws, offs, out, n, k, BM=block_m, BN=BLOCK, BK=BLOCK, PRECISION=dot_precision(xs.dtype),
        num_warps=4, num_stages=4,
    )  # fmt: skip
    return out


def moe_experts_fp8(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up_q: torch.Tensor,
    gate_up_s: torch.Tensor,
    down_q: torch.Tensor,
    down_s: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``kernels.moe.moe_experts`` with FP8 block-scaled expert weights (module docstring)."""
    return quantized_moe_experts(
        x, weights, indices, gate_up_q, gate_up_s, down_q, down_s, limit, dequantize_blocks, fp8_grouped_linear,
    )  # fmt: skip


Dequant = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
GroupedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_linear_reference(
    xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, dequant: Dequant, out: torch.Tensor
) -> torch.Tensor:
    """The grouped GEMM without Triton: each non-empty group's rows times ``dequant(wq[g], ws[g])ᵀ``, into ``out``."""
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = xs[start:end] @ dequant(wq[g], ws[g], xs.dtype).t()
        start = end
    return out


def default_block_m(m: int, e: int) -> int:
    """Row tile of the grouped kernels from the rows per expert on average (decode ~1-3, prefill many)."""
    return min(64, max(16, next_pow2(triton.cdiv(m, e))))


def quantized_moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up_q: torch.Tensor,
    gate_up_s: torch.Tensor,
    down_q: torch.Tensor,
    down_s: torch.Tensor,
    limit: float,
    dequant: Dequant,
    linear: GroupedLinear,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.moe.moe_experts`` with quantised expert weights: the dequantised reference
    without Triton, else ``grouped_experts`` over ``linear``; ``add`` joins the sum."""
    from kernels.moe import grouped_experts, moe_experts_reference

    if not use_triton(x):
        gu = dequant(gate_up_q, gate_up_s, x.dtype)
        dn = dequant(down_q, down_s, x.dtype)
        out = moe_experts_reference(x, weights, indices, gu, dn, limit)
        return out if add is None else out + add
    return grouped_experts(
        x, weights, indices, gate_up_q.shape[0], gate_up_q.shape[1] // 2, limit,
        lambda xs, offs, _counts: linear(xs, gate_up_q, gate_up_s, offs),
        lambda act, offs, _counts: linear(act, down_q, down_s, offs), add=add,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _fp8_grouped_kernel(
        x_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr
    ):
        e = tl.program_id(0)
        nb = tl.program_id(1)
        end = tl.load(offs_ptr + e)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        if end > start:
            cols = nb * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            ty = out_ptr.dtype.element_ty
            w_base = w_ptr + e.to(tl.int64) * N * K
            s_base = s_ptr + (e.to(tl.int64) * (N // BN) + nb) * (K // BK)
            for m0 in range(start, end, BM):
                rows = m0 + tl.arange(0, BM)
                r_ok = rows < end
                acc = tl.zeros((BM, BN), tl.float32)
                for k0 in range(0, K, BK):
                    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + k0 + kk[None, :], mask=r_ok[:, None], other=0.0)
                    w = tl.load(w_base + cols[None, :].to(tl.int64) * K + k0 + kk[:, None])  # (BK, BN)
                    s = tl.load(s_base + k0 // BK)
                    acc += mma(x, w.to(ty), PRECISION) * s
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(ty), mask=r_ok[:, None])


__all__ = ["dequantize_blocks", "fp8_grouped_linear", "moe_experts_fp8", "quantize_blocks"]
