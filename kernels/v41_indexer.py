"""DeepSeek-V4.1's indexer scores over stored FP4 keys, dequantised in the kernel.

For each batch row ``b`` (one query token) and each column ``t`` of its slot's keys:
``score[b, t] = Σ_h w[b, h] · relu(q[b, h] · k[slot_b, t]) · scale``, ``-inf`` from
``complete[b]`` on (rows not yet complete). Level two of the two-level top-k is ``topk`` over
these (after level one's candidate mask), as ``engine.model.v41.attention.Indexer.select`` does.
Layout (``kernels.v41_kv``)::

    q       (B, Hi, Di)   fp32, already FP4-rounded     w (B, Hi) fp32
    keys_q  (S, T, Di/2)  uint8 packed e2m1             keys_e (S, T, Di/32) uint8 ue8m0
    slot, complete (B,) int

The Triton kernel: grid ``(B, cdiv(T, BT))``; a program decodes ``BT`` keys in registers and
takes one ``(Hi, BT)`` product with all heads' queries.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, dot_precision, next_pow2, use_triton
from kernels.v41_kv import unpack_fp4_keys

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kernels._common import mma
    from kernels.v41_attention import _e2m1

    @triton.jit
    def _v41_scores_kernel(
        q_ptr, w_ptr, kq_ptr, ke_ptr, slot_ptr, comp_ptr, out_ptr, HI, T, scale,
        s_qb, s_qh, s_wb, s_ks, s_kn, s_es, s_en, s_ob,
        DI: tl.constexpr, BHI: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        cols = tl.program_id(1) * BT + tl.arange(0, BT)
        heads = tl.arange(0, BHI)
        dims = tl.arange(0, DI)
        hmask = heads < HI
        slot = tl.load(slot_ptr + b)
        complete = tl.load(comp_ptr + b)
        inside = cols < T
        q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dims[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)  # (BHI, DI)
        w = tl.load(w_ptr + b * s_wb + heads, mask=hmask, other=0.0)  # (BHI,)
        byte = tl.load(kq_ptr + slot * s_ks + cols[:, None] * s_kn + dims[None, :] // 2, mask=inside[:, None], other=0).to(tl.int32)
        ex = tl.load(ke_ptr + slot * s_es + cols[:, None] * s_en + dims[None, :] // 32, mask=inside[:, None], other=127).to(tl.int32)
        k = _e2m1((byte >> ((dims[None, :] % 2) * 4)) & 15) * (ex << 23).to(tl.float32, bitcast=True)  # (BT, DI)
        s = tl.maximum(mma(q, tl.trans(k), PRECISION), 0.0) * scale  # (BHI, BT)
        score = tl.sum(s * w[:, None], 0)  # (BT,)
        score = tl.where(cols < complete, score, float("-inf"))
        tl.store(out_ptr + b * s_ob + cols, score, mask=inside)


def v41_indexer_scores_reference(
    q: torch.Tensor, w: torch.Tensor, keys_q: torch.Tensor, keys_e: torch.Tensor, slot: torch.Tensor, complete: torch.Tensor, scale: float
) -> torch.Tensor:
    """The module's scores in PyTorch → ``(B, T)`` fp32."""
    keys = unpack_fp4_keys(keys_q[slot], keys_e[slot])  # (B, T, Di)
    s = torch.einsum("bhd,btd->bht", q.float(), keys).relu_() * scale  # (B, Hi, T)
    s = (s * w.float().unsqueeze(-1)).sum(dim=1)
    return s.masked_fill(torch.arange(keys.shape[1], device=q.device)[None] >= complete[:, None], float("-inf"))


def v41_indexer_scores(
    q: torch.Tensor, w: torch.Tensor, keys_q: torch.Tensor, keys_e: torch.Tensor, slot: torch.Tensor, complete: torch.Tensor,
    scale: float, block_t: int = 64,
) -> torch.Tensor:  # fmt: skip
    """Indexer scores ``(B, T)`` over stored FP4 keys (module docstring): the Triton kernel where
    it runs, else ``v41_indexer_scores_reference``."""
    if not use_triton(q):
        return v41_indexer_scores_reference(q, w, keys_q, keys_e, slot, complete, scale)
    b, hi, di = q.shape
    t = keys_q.shape[1]
    assert di == next_pow2(di) and di % 32 == 0, "index_head_dim must be a power of two, a multiple of 32"
    w = w.float().contiguous()
    out = torch.empty(b, t, dtype=torch.float32, device=q.device)
    _v41_scores_kernel[(b, triton.cdiv(t, block_t))](
        q, w, keys_q, keys_e, slot, complete, out, hi, t, float(scale),
        q.stride(0), q.stride(1), w.stride(0), keys_q.stride(0), keys_q.stride(1), keys_e.stride(0), keys_e.stride(1), out.stride(0),
        DI=di, BHI=max(16, next_pow2(hi)), BT=block_t, PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out
