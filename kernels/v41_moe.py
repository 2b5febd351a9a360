"""DeepSeek-V4.1's routed-expert glue in ``MoE.forward``'s rounding order, for the fast path's
grouped expert GEMMs (``engine.model.v41.prefill.moe``).

``weighted_swiglu``: ``act = (w · (silu(min(g, L)) · clamp(u, -L, L))).to(dtype)`` of the gate|up
GEMM's rows ``h (M, 2I)`` and each row's routing weight ``w (M,)``, in fp32 as ``Expert.forward``
(``F.silu`` as PyTorch's CUDA kernel computes it: ``g / (1 + expf(-g))``, correctly rounded
division; L ≤ 0: no clamps). One program per row and ``BLOCK`` columns.

``combine_in_order``: ``out[t] = ((0 + y[r(t, 0)]) + y[r(t, 1)] + ... + y[r(t, k-1)]) + add[t]`` in fp32, cast once:
the rows ``y (M, H)`` of the grouped down projection (routing weights already applied), each
token's ``k`` rows in the order of ``row_of_slot (N·k,)`` (the caller sorts a token's picks by
expert id, the order the general path adds them in), then the shared expert's ``add (N, H)``.
``kernels.moe.combine_rows`` adds ``add`` first and multiplies by the weights: same math, other
last bits. One program per token and ``BLOCK`` channels; off CUDA without the interpreter the
PyTorch reference.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, INTERPRET, next_pow2, tl, triton, use_triton


def weighted_swiglu_reference(h: torch.Tensor, w: torch.Tensor, limit: float) -> torch.Tensor:
    """``Expert.forward``'s ops between its projections, on the rows of ``h (M, 2I)``."""
    gate, up = h.float().chunk(2, dim=-1)
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    return (w[:, None] * (torch.nn.functional.silu(gate) * up)).to(h.dtype)


def weighted_swiglu(h: torch.Tensor, w: torch.Tensor, limit: float) -> torch.Tensor:
    """``h (M, 2I)`` gate | up, ``w (M,)`` fp32 → ``(M, I)`` in ``h``'s dtype (module docstring)."""
    if not use_triton(h):
        return weighted_swiglu_reference(h, w, limit)
    m, two_i = h.shape
    inter = two_i // 2
    h, w = h.contiguous(), w.float().contiguous()
    out = torch.empty(m, inter, dtype=h.dtype, device=h.device)
    if m:
        block = min(1024, next_pow2(inter))
        _swiglu_kernel[(m, triton.cdiv(inter, block))](
            h, w, out, inter, float(limit), HAS_LIMIT=limit > 0, EXACT=not INTERPRET, BLOCK=block, num_warps=4
        )  # fmt: skip
    return out


def combine_in_order_reference(y: torch.Tensor, row_of_slot: torch.Tensor, k: int, add: torch.Tensor) -> torch.Tensor:
    """The module's sum in PyTorch ops (``MoE.forward``'s)."""
    y_k = y[row_of_slot].view(add.shape[0], k, -1).float()  # (N, k, H)
    out = torch.zeros_like(add, dtype=torch.float32)
    for j in range(k):
        out = out + y_k[:, j]
    return (out + add.float()).to(add.dtype)


def combine_in_order(y: torch.Tensor, row_of_slot: torch.Tensor, k: int, add: torch.Tensor) -> torch.Tensor:
    """``y (M, H)``, ``row_of_slot (N·k,)`` int, ``add (N, H)`` → ``(N, H)`` in ``add``'s dtype."""
    if not use_triton(y):
        return combine_in_order_reference(y, row_of_slot, k, add)
    n, hidden = add.shape
    y, add, row_of_slot = y.contiguous(), add.contiguous(), row_of_slot.contiguous()
    out = torch.empty_like(add)
    if n:
        block = min(1024, next_pow2(hidden))
        _combine_kernel[(n, triton.cdiv(hidden, block))](y, row_of_slot, add, out, hidden, K=k, BLOCK=block, num_warps=4)
    return out


if HAS_TRITON:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _swiglu_kernel(h_ptr, w_ptr, out_ptr, I, limit, HAS_LIMIT: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        g = tl.load(h_ptr + m * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + m * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        if EXACT:  # PyTorch's CUDA silu: x / (1 + expf(-x)), IEEE exp and division
            silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
        else:  # the interpreter (numpy): the same formula
            silu = g / (1.0 + tl.exp(-g))
        out = tl.load(w_ptr + m) * (silu * u)
        tl.store(out_ptr + m * I + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_kernel(y_ptr, row_ptr, add_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(row_ptr + n * K + j).to(tl.int64)
            acc += tl.load(y_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(add_ptr + n * H + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
