"""The mixing weights of DeepSeek-V4's hyper-connections (mHC) in one kernel.

``HyperConnection.forward`` (``engine.model.layers``) turns each token's ``mixes (N, (2+hc)·hc)``
(fp32, ``F.linear`` of the normalised streams) into::

    pre  = sigmoid(mixes[:hc] · scale[0] + base[:hc]) + eps                         (N, hc)
    post = 2 · sigmoid(mixes[hc:2hc] · scale[1] + base[hc:2hc])                      (N, hc)
    comb = sinkhorn(softmax_j(mixes[2hc:] · scale[2] + base[2hc:]) + eps, iters)     (N, hc, hc)

with Sinkhorn = columns, then ``iters - 1`` rounds of rows and columns, each ``x / (sum + eps)``.
In PyTorch that is ~``4·iters`` launches of tiny elementwise kernels per call (~80 at
``iters=20``), twice per layer: at decode, under a CUDA graph, launch latency is most of their
cost. Here one program holds ``BLOCK_N`` tokens' ``(hc, hc)`` matrices in registers for all
iterations. fp32 throughout; the same operations in the same order (sums of ``hc`` terms), so
the result equals the PyTorch one to rounding (Triton's fp32 division is not IEEE-rounded).
"""

from __future__ import annotations

import torch

from kernels.reference import mix_gates
from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton

hc_mix_reference = mix_gates  # the math of ``HyperConnection.forward`` after its ``F.linear``
PRESUM_SPLITS = 8  # hc_mix_parts: above this many splits, add them in tiles before the gates


def hc_mix(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    *,
    block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``hc_mix_reference``: ``mixes (N, (2+hc)·hc)`` fp32 → pre ``(N, hc)``, post
    ``(N, hc)``, comb ``(N, hc, hc)``, all fp32 and contiguous."""
    if not use_triton(mixes):
        return hc_mix_reference(mixes, scale, base, hc, iters, eps)
    n, m = mixes.shape
    assert m == (2 + hc) * hc and mixes.stride(-1) == 1 and mixes.dtype == torch.float32
    pre = torch.empty(n, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty(n, hc, dtype=torch.float32, device=mixes.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=mixes.device)
    if n:
        _hc_mix_kernel[(triton.cdiv(n, block_n),)](
            mixes, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
            n, mixes.stride(0), iters, eps, 0, 1, 1, 0.0, mixes,
            HC=hc, HC_PAD=next_pow2(hc), BLOCK_N=block_n, NORM=False, SQ=m, MP=1, PRESUM=False, SB=1,
            HEAD=False, num_warps=4,
        )  # fmt: skip
    return pre, post, comb


def hc_mix_parts(
    parts: torch.Tensor,
    k: int,
    norm_eps: float,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    *,
    block_n: int = 32,
    head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_mix`` of split-K partial sums (``kernels.fused.hc_pre_parts``): ``parts (N, S, MP)``
    fp32 holds, per split, the ``M = (2+hc)·hc`` dot products of the raw streams with ``fn`` and,
    in column ``M``, their sum of squares; the kernel adds the splits and applies the RMS scale
    ``rsqrt(Σx²/k + norm_eps)`` before the gates (``HyperConnection``'s norm, moved past the
    linear map). ``head``: ``M = hc`` (``HyperHead``: ``pre`` only, ``scale (1,)``, ``base (hc,)``;
    ``post`` and ``comb`` come back empty). More than ``PRESUM_SPLITS`` splits are added in
    vectorised tiles first (decode at batch 1-2 splits the dot 64 ways). Triton only (the caller
    checks ``use_triton``)."""
    n = parts.shape[0]
    gates, args, consts, warps = mix_parts_launch(parts, k, norm_eps, scale, base, hc, iters, eps, block_n, head)
    if n:
        _hc_mix_kernel[(triton.cdiv(n, consts["BLOCK_N"]),)](*args, **consts, num_warps=warps)
    return gates


def mix_parts_launch(
    parts: torch.Tensor, k: int, norm_eps: float, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
    eps: float, block_n: int = 32, head: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple, dict, int]:  # fmt: skip
    """``hc_mix_parts``' outputs (empty), ``hc_mix_block``'s arguments after ``block`` as
    positional values and constexpr keywords (``BLOCK_N``: rows per program), and the warps per
    program of ``_hc_mix_kernel``'s launch (its presum tiles are sized for them)."""
    n, splits, mp = parts.shape
    block_n = min(block_n, max(2, next_pow2(n)))  # few rows: a small tile, one warp
    warps = 1 if block_n <= 4 else 4
    m = hc if head else (2 + hc) * hc
    assert mp > m and parts.is_contiguous() and parts.dtype == torch.float32
    pre = torch.empty(n, hc, dtype=torch.float32, device=parts.device)
    post = torch.empty(0 if head else n, hc, dtype=torch.float32, device=parts.device)
    comb = torch.empty(0 if head else n, hc, hc, dtype=torch.float32, device=parts.device)
    presum = splits > PRESUM_SPLITS
    sums = torch.empty(n, mp, dtype=torch.float32, device=parts.device) if presum else parts
    # splits added per step of the presum loop: a (block_n, sb, mp) tile of ~64 values per thread
    sb = min(next_pow2(splits), max(1, 64 * 32 * warps // (block_n * mp)))
    args = (parts, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
            n, splits * mp, iters, eps, mp, splits, k, norm_eps, sums)  # fmt: skip
    consts = dict(HC=hc, HC_PAD=next_pow2(hc), BLOCK_N=block_n, NORM=True, SQ=m, MP=mp, PRESUM=presum, SB=sb, HEAD=head)
    return (pre, post, comb), args, consts, warps


if HAS_TRITON:

    @triton.jit
    def _load_mix(ptr, mask, stride_s, splits):
        """Sum of ``splits`` partial tiles ``stride_s`` apart (one tile when ``splits == 1``)."""
        x = tl.load(ptr, mask=mask, other=0.0)
        for s in range(1, splits):
            x += tl.load(ptr + s * stride_s, mask=mask, other=0.0)
        return x

    @triton.jit
    def _hc_mix_kernel(
        mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
        N, stride_m, iters, eps, stride_s, splits, norm_k, norm_eps, sum_ptr,
        HC: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
        SQ: tl.constexpr, MP: tl.constexpr, PRESUM: tl.constexpr, SB: tl.constexpr, HEAD: tl.constexpr,
    ):  # fmt: skip
        hc_mix_block(
            tl.program_id(0), mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
            N, stride_m, iters, eps, stride_s, splits, norm_k, norm_eps, sum_ptr,
            HC, HC_PAD, BLOCK_N, NORM, SQ, MP, PRESUM, SB, HEAD,
        )  # fmt: skip

    @triton.jit
    def hc_mix_block(
        block, mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
        N, stride_m, iters, eps, stride_s, splits, norm_k, norm_eps, sum_ptr,
        HC: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
        SQ: tl.constexpr, MP: tl.constexpr, PRESUM: tl.constexpr, SB: tl.constexpr, HEAD: tl.constexpr,
    ):  # fmt: skip
        """The gates of rows ``[block·BLOCK_N, (block+1)·BLOCK_N)`` (``_hc_mix_kernel``'s program
        ``block``; a fused kernel calls it from some of its programs, ``kernels.v41_mhc``)."""
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        r_ok = rows < N
        c = tl.arange(0, HC_PAD)  # (HCP,)
        c_ok = c < HC
        rows64 = rows.to(tl.int64)
        mask2 = r_ok[:, None] & c_ok[None, :]
        if PRESUM:  # many splits: add them in (BN, SB, MP) tiles into this block's rows of sum_ptr
            mc = tl.arange(0, MP)
            sb = tl.arange(0, SB)
            tot = tl.zeros([BLOCK_N, MP], dtype=tl.float32)
            for s0 in range(0, splits, SB):
                ss = s0 + sb
                tile = tl.load(
                    mix_ptr + rows64[:, None, None] * stride_m + ss[None, :, None] * stride_s + mc[None, None, :],
                    mask=r_ok[:, None, None] & (ss < splits)[None, :, None], other=0.0,
                )  # fmt: skip
                tot += tl.sum(tile, axis=1)
            tl.store(sum_ptr + rows64[:, None] * MP + mc[None, :], tot, mask=r_ok[:, None])
            tl.debug_barrier()  # this block's sums visible to all its threads
            mix_ptr = sum_ptr
            stride_m = MP
            splits = 1
        s_pre = tl.load(scale_ptr)
        # pre / post: (BN, HCP)
        if NORM:  # column SQ holds the sum of squares: the RMS scale of each row
            sq = _load_mix(mix_ptr + rows64 * stride_m + SQ, r_ok, stride_s, splits)
            rs = (1.0 / tl.sqrt(sq / norm_k + norm_eps))[:, None]
        else:
            rs = tl.full((BLOCK_N, 1), 1.0, tl.float32)
        x = _load_mix(mix_ptr + rows64[:, None] * stride_m + c[None, :], mask2, stride_s, splits) * rs
        b = tl.load(base_ptr + c, mask=c_ok, other=0.0)
        pre = 1.0 / (1.0 + tl.exp(-(x * s_pre + b[None, :]))) + eps
        tl.store(pre_ptr + rows64[:, None] * HC + c[None, :], pre, mask=mask2)
        if not HEAD:  # post and the Sinkhorn-normalised comb
            s_post = tl.load(scale_ptr + 1)
            s_comb = tl.load(scale_ptr + 2)
            x = _load_mix(mix_ptr + rows64[:, None] * stride_m + HC + c[None, :], mask2, stride_s, splits) * rs
            b = tl.load(base_ptr + HC + c, mask=c_ok, other=0.0)
            post = 2.0 / (1.0 + tl.exp(-(x * s_post + b[None, :])))
            tl.store(post_ptr + rows64[:, None] * HC + c[None, :], post, mask=mask2)
            # comb: (BN, HCP_i, HCP_j)
            i3 = c[None, :, None]
            j3 = c[None, None, :]
            ok3 = r_ok[:, None, None] & (i3 < HC) & (j3 < HC)
            off = 2 * HC + i3 * HC + j3
            x = _load_mix(mix_ptr + rows64[:, None, None] * stride_m + off, ok3, stride_s, splits) * rs[:, :, None]
            b = tl.load(base_ptr + off, mask=(i3 < HC) & (j3 < HC), other=0.0)
            z = tl.where(ok3, x * s_comb + b, float("-inf"))
            z = tl.exp(z - tl.max(z, axis=2)[:, :, None])
            z = z / tl.sum(z, axis=2)[:, :, None] + eps  # softmax over j, + eps
            z = tl.where(ok3, z, 0.0)
            z = z / (tl.sum(z, axis=1)[:, None, :] + eps)  # columns: sum over i
            for _ in range(iters - 1):
                z = z / (tl.sum(z, axis=2)[:, :, None] + eps)  # rows: sum over j
                z = z / (tl.sum(z, axis=1)[:, None, :] + eps)  # columns
            tl.store(
                comb_ptr + rows64[:, None, None] * (HC * HC) + i3 * HC + j3, z, mask=ok3
            )


__all__ = ["hc_mix", "hc_mix_parts", "hc_mix_reference", "mix_parts_launch"]
