"""DeepSeek-V4.1's mHC collapse and expand for many tokens, one pass over the streams each.

The general path (``engine.model.v41.layers``) widens the ``(N, hc, H)`` streams to fp32 copies
for both; at an 8K prefill of V4.1-Flash width that is ~0.7 GB per copy and several passes per
site. These kernels read the streams once, keep the general path's roundings (fp32 math, one
cast where it casts) and write the result once:

- ``collapse_norm``: ``RMSNorm(collapse(pre, streams))`` — ``x = Σ_s pre_s · streams_s`` in fp32,
  cast to the streams' dtype; ``y = x · rsqrt(mean(x²) + eps)`` cast; ``weight`` (cast) ``· y``;
- ``expand``: ``out_k = post_k · x + Σ_j comb[j, k] · streams_j`` in fp32, cast once.

Grid: one program per token (``collapse_norm``: the whole row in registers for its norm) or per
token and ``BH`` channels (``expand``). Off CUDA without the interpreter: the general path's ops.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton


def collapse_norm_reference(pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``layers.RMSNorm(layers.collapse(pre, streams))`` in PyTorch ops."""
    x = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)  # (N, H)
    h = x.float()
    return weight.to(x.dtype) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def expand_reference(x: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``layers.expand`` in PyTorch ops."""
    mixed = torch.einsum("bsjk,bsjd->bskd", comb.float()[None], streams.float()[None])[0]  # (N, hc, H)
    return (post.unsqueeze(-1) * x.float().unsqueeze(-2) + mixed).to(streams.dtype)


def collapse_norm(pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``pre (N, hc)`` fp32, ``streams (N, hc, H)``, ``weight (H,)`` → ``(N, H)`` in the streams' dtype."""
    if not use_triton(streams):
        return collapse_norm_reference(pre, streams, weight, eps)
    n, hc, h = streams.shape
    streams, pre, weight = streams.contiguous(), pre.float().contiguous(), weight.contiguous()
    out = torch.empty(n, h, dtype=streams.dtype, device=streams.device)
    if n:
        bh = next_pow2(h)
        _collapse_norm_kernel[(n,)](pre, streams, weight, out, h, float(eps), HC=hc, BH=bh, num_warps=8 if bh >= 2048 else 4)
    return out


def expand(x: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, block_h: int = 1024) -> torch.Tensor:
    """``x (N, H)``, ``streams (N, hc, H)``, ``post (N, hc)``, ``comb (N, hc, hc)`` fp32 → new streams ``(N, hc, H)``."""
    if not use_triton(streams):
        return expand_reference(x, streams, post, comb)
    n, hc, h = streams.shape
    streams, x = streams.contiguous(), x.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(streams)
    bh = min(block_h, next_pow2(h))
    if n:
        _expand_kernel[(n, triton.cdiv(h, bh))](x, streams, post, comb, out, h, HC=hc, BH=bh, num_warps=4)
    return out


if HAS_TRITON:

    @triton.jit
    def _collapse_norm_kernel(pre_ptr, s_ptr, w_ptr, out_ptr, H, eps, HC: tl.constexpr, BH: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        ok = h < H
        ty = out_ptr.dtype.element_ty
        acc = tl.zeros((BH,), tl.float32)
        for s in tl.static_range(HC):
            acc += tl.load(pre_ptr + n * HC + s) * tl.load(s_ptr + (n * HC + s) * H + h, mask=ok, other=0.0).to(tl.float32)
        x = acc.to(ty).to(tl.float32)  # collapse returns the streams' dtype
        y = (x * tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)).to(ty).to(tl.float32)
        w = tl.load(w_ptr + h, mask=ok, other=0.0).to(ty).to(tl.float32)
        tl.store(out_ptr + n * H + h, (w * y).to(ty), mask=ok)

    @triton.jit
    def _expand_kernel(x_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, H, HC: tl.constexpr, BH: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = h < H
        ty = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + n * H + h, mask=ok, other=0.0).to(tl.float32)
        for k in tl.static_range(HC):
            mixed = tl.zeros((BH,), tl.float32)
            for j in tl.static_range(HC):
                c = tl.load(comb_ptr + (n * HC + j) * HC + k)  # comb[n, j, k]
                mixed += c * tl.load(s_ptr + (n * HC + j) * H + h, mask=ok, other=0.0).to(tl.float32)
            out = tl.load(post_ptr + n * HC + k) * x + mixed
            tl.store(out_ptr + (n * HC + k) * H + h, out.to(ty), mask=ok)
