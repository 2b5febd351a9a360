"""DeepSeek-V4.1's routed-expert combine in ``MoE.forward``'s summation order.

``out[t] = ((0 + y[r(t, 0)]) + y[r(t, 1)] + ... + y[r(t, k-1)]) + add[t]`` in fp32, cast once:
the rows ``y (M, H)`` of the grouped down projection (routing weights already applied), each
token's ``k`` rows in the order of ``row_of_slot (N·k,)`` (the caller sorts a token's picks by
expert id, the order the general path adds them in), then the shared expert's ``add (N, H)``.
``kernels.moe.combine_rows`` adds ``add`` first and multiplies by the weights: same math, other
last bits. One program per token and ``BLOCK`` channels; off CUDA without the interpreter the
PyTorch reference.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton


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
