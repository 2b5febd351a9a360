"""Gated pooling of DeepSeek-V4's compressors (CSA, HCA and the CSA indexer), batched over windows.

A compressor projects every token to ``kv`` and ``gate`` of width ``P``; every ``r`` tokens close a
window that pools into one row of width ``d``::

    row = Σ_slots softmax_slots(gate + position_bias) · kv

- HCA (``overlap=False``, ``P = d``): the window's own ``r`` tokens.
- CSA (``overlap=True``, ``P = 2d``): ``2r`` slots — the previous window's tokens, first series
  ``[:d]`` (Ca), then this window's tokens, second series ``[d:]`` (Cb). A sequence's first window
  has no previous one: those ``r`` slots are left out of the softmax.

``position_bias[s]`` goes with slot ``s`` of the token's own window (``s < r``), both halves.
Windows are given by token-row indices into token-major tensors, so one call pools windows of any
number of sequences, wherever their tokens lie (a prefill chunk, a decode step's buffers)::

    kv, gate    (N, P)   raw projections (``kv_proj(x)``, ``gate_proj(x)``), bias NOT added
    bias        (r, P)   fp32 ``position_bias``
    win_start   (n,) int row of window i's first token (its r tokens are consecutive rows)
    prev_start  (n,) int CSA: row of the previous window's first token, -1 = none
    → pooled    (n, d)   in kv's dtype; the caller applies ``kv_norm`` and RoPE as before

(The model's ``CompressorState.overlap_gate`` holds gates with the bias already added; keep the raw
gates instead, or subtract the bias, when feeding them here.)
The Triton kernel: grid ``(n, d / BD)``; a program loads its window's slots × ``BD`` channels of
kv and gate once, softmax over slots in fp32, weighted sum; no ``(n, 2r, d)`` pool is built.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton


def gated_pool_reference(
    kv: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    win_start: torch.Tensor,
    prev_start: torch.Tensor | None = None,
    overlap: bool = False,
) -> torch.Tensor:
    """The pooling of ``Compressor.update``, gathered from token rows. → ``(n, d)``."""
    r, p = bias.shape
    d = p // 2 if overlap else p
    slots = torch.arange(r, device=kv.device)
    idx = win_start.long()[:, None] + slots  # (n, r)
    ckv = kv[idx]  # (n, r, P)
    cgate = gate[idx] + bias  # (n, r, P) fp32
    if overlap:
        n = idx.shape[0]
        has_prev = (prev_start >= 0)[:, None, None]  # (n, 1, 1)
        pidx = prev_start.long().clamp(min=0)[:, None] + slots  # (n, r)
        pool_kv = torch.cat([torch.where(has_prev, kv[pidx][..., :d], 0), ckv[..., d:]], dim=1)  # (n, 2r, d)
        prev_gate = torch.where(has_prev, (gate[pidx] + bias)[..., :d], float("-inf"))
        pool_gate = torch.cat([prev_gate, cgate[..., d:]], dim=1)  # (n, 2r, d)
        assert pool_kv.shape == (n, 2 * r, d)
    else:
        pool_kv, pool_gate = ckv, cgate
    return (pool_kv * pool_gate.softmax(dim=1, dtype=torch.float32).to(pool_kv.dtype)).sum(dim=1)


def gated_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    win_start: torch.Tensor,
    prev_start: torch.Tensor | None = None,
    overlap: bool = False,
    *,
    block_d: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Pool ``n`` windows (layout in the module docstring). → ``(n, d)`` in ``kv.dtype``."""
    if not use_triton(kv):
        return gated_pool_reference(kv, gate, bias, win_start, prev_start, overlap)
    r, p = bias.shape
    d = p // 2 if overlap else p
    n = win_start.shape[0]
    assert kv.shape[1] == p and gate.shape[1] == p and kv.stride(-1) == 1 and gate.stride(-1) == 1
    assert not overlap or prev_start is not None, "CSA pooling needs prev_start"
    out = torch.empty(n, d, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    slots_pad = next_pow2(2 * r if overlap else r)
    block_d = block_d or max(16, min(next_pow2(d), 4096 // slots_pad))
    bias = bias.float().contiguous()
    _gated_pool_kernel[(n, triton.cdiv(d, block_d))](
        kv, gate, bias, win_start, prev_start if overlap else win_start, out,
        d, r, kv.stride(0), gate.stride(0), out.stride(0),
        SLOTS_PAD=slots_pad, BD=block_d, OVERLAP=overlap, num_warps=num_warps,
    )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def _gated_pool_kernel(
        kv_ptr, gate_ptr, bias_ptr, win_ptr, prev_ptr, out_ptr,
        d, R, stride_kv, stride_g, stride_o,
        SLOTS_PAD: tl.constexpr, BD: tl.constexpr, OVERLAP: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        offs_c = tl.program_id(1) * BD + tl.arange(0, BD)  # (BD,) output channels
        offs_s = tl.arange(0, SLOTS_PAD)  # (SLOTS_PAD,)
        c_ok = offs_c < d
        win = tl.load(win_ptr + i).to(tl.int64)
        if OVERLAP:
            prev = tl.load(prev_ptr + i).to(tl.int64)
            first = offs_s < R  # slots of the previous window (Ca series)
            row = tl.where(first, prev + offs_s, win + offs_s - R)
            has_prev = (tl.zeros([SLOTS_PAD], dtype=tl.int64) + prev) >= 0  # (SLOTS_PAD,)
            s_ok = (first & has_prev) | ((offs_s >= R) & (offs_s < 2 * R))
            col = offs_c[None, :] + tl.where(first, 0, d)[:, None]  # (SLOTS_PAD, BD)
            bias_row = tl.where(first, offs_s, offs_s - R)
            p = 2 * d
        else:
            row = win + offs_s
            s_ok = offs_s < R
            col = offs_c[None, :] + tl.zeros([SLOTS_PAD], dtype=tl.int32)[:, None]
            bias_row = offs_s
            p = d
        row = tl.where(s_ok, row, 0)
        mask = s_ok[:, None] & c_ok[None, :]
        kv = tl.load(kv_ptr + row[:, None] * stride_kv + col, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + row[:, None] * stride_g + col, mask=mask, other=0.0).to(tl.float32)
        g += tl.load(bias_ptr + tl.where(s_ok, bias_row, 0)[:, None] * p + col, mask=mask, other=0.0)
        g = tl.where(s_ok[:, None], g, float("-inf"))
        e = tl.exp(g - tl.max(g, axis=0)[None, :])  # (SLOTS_PAD, BD)
        pooled = tl.sum(kv * e, axis=0) / tl.sum(e, axis=0)  # (BD,)
        tl.store(out_ptr + i.to(tl.int64) * stride_o + offs_c, pooled.to(out_ptr.dtype.element_ty), mask=c_ok)


def gated_pool_cost(n: int, r: int, d: int, overlap: bool, elem: int = 2) -> tuple[float, float]:
    """Fewest bytes (slots of kv and gate read, rows written) and FLOPs of one pooling call."""
    slots = 2 * r if overlap else r
    nbytes = elem * n * (2 * slots * d + d)
    flops = 5.0 * n * slots * d
    return nbytes, flops
