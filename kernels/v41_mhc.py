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

At decode a site is four launches (``fused.hc_pre_parts``, ``mhc.hc_mix_parts``, ``collapse_norm``,
``expand``), latency-bound at batch 1. ``mix_collapse_norm`` runs the site's gates
(``mhc.hc_mix_block``) and ``collapse_norm`` with the previous site's ``pre``, which do not depend
on each other, side by side in one grid: programs ``[0, N)`` collapse a token each, the rest
compute the gates of ``BLOCK_N`` tokens each. (Fusing ``expand`` into the next site's split-K
dot as well was slower at batch 1 and 64 on the H200, NOTES run 51.)
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton
from kernels.mhc import mix_parts_launch


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


def mix_collapse_norm(
    parts: torch.Tensor, k: int, norm_eps: float, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
    hc_eps: float, pre: torch.Tensor, streams: torch.Tensor, weight: torch.Tensor, eps: float, *, block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``mhc.hc_mix_parts(parts, k, norm_eps, scale, base, hc, iters, hc_eps)`` and
    ``collapse_norm(pre, streams, weight, eps)`` in one launch → the gates' ``pre, post, comb`` and
    the normed collapse ``(N, H)``. Triton only. The gates' programs run with the collapse's warps:
    their sums are the same terms, in a reduction tree that may differ in the last bit."""
    n, _, h = streams.shape
    streams, pre, weight = streams.contiguous(), pre.float().contiguous(), weight.contiguous()
    out = torch.empty(n, h, dtype=streams.dtype, device=streams.device)
    bh = next_pow2(h)
    warps = 8 if bh >= 2048 else 4
    gates, args, consts, _ = mix_parts_launch(parts, k, norm_eps, scale, base, hc, iters, hc_eps, block_n)
    if n:
        _mix_collapse_norm_kernel[(n + triton.cdiv(n, consts["BLOCK_N"]),)](
            pre, streams, weight, out, h, float(eps), *args, BH=bh, **consts, num_warps=warps
        )  # fmt: skip
    return (*gates, out)


if HAS_TRITON:
    from kernels.mhc import hc_mix_block

    @triton.jit
    def _collapse_norm_kernel(pre_ptr, s_ptr, w_ptr, out_ptr, H, eps, HC: tl.constexpr, BH: tl.constexpr):
        _collapse_norm_row(tl.program_id(0).to(tl.int64), pre_ptr, s_ptr, w_ptr, out_ptr, H, eps, HC, BH)

    @triton.jit
    def _mix_collapse_norm_kernel(
        pre_ptr, s_ptr, w_ptr, out_ptr, H, eps,
        mix_ptr, scale_ptr, base_ptr, gpre_ptr, post_ptr, comb_ptr,
        N, stride_m, iters, hc_eps, stride_s, splits, norm_k, norm_eps, sum_ptr,
        BH: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
        SQ: tl.constexpr, MP: tl.constexpr, PRESUM: tl.constexpr, SB: tl.constexpr, HEAD: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        if pid < N:
            _collapse_norm_row(pid.to(tl.int64), pre_ptr, s_ptr, w_ptr, out_ptr, H, eps, HC, BH)
        else:
            hc_mix_block(
                pid - N, mix_ptr, scale_ptr, base_ptr, gpre_ptr, post_ptr, comb_ptr,
                N, stride_m, iters, hc_eps, stride_s, splits, norm_k, norm_eps, sum_ptr,
                HC, HC_PAD, BLOCK_N, NORM, SQ, MP, PRESUM, SB, HEAD,
            )  # fmt: skip

    @triton.jit
    def _collapse_norm_row(n, pre_ptr, s_ptr, w_ptr, out_ptr, H, eps, HC: tl.constexpr, BH: tl.constexpr):
        """``collapse_norm`` of token ``n``."""
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
