"""Routed experts (and the shared expert) for a few tokens: two weight-streaming GEMV kernels.

At decode batch 1-32 the routed experts are ``n·k <= 192`` rows against up to ``n·k`` different experts:
``kernels.moe.moe_experts`` (sort, gather, ``torch._grouped_mm`` on tiny groups, SwiGLU, combine:
~15 launches) reads their weights at ~53% of the copy bandwidth (NOTES run 2). Here::

    act[s] = swiglu(x[t] @ gate_up[e]ᵀ)    one program per (slot s = (token t, pick j), BI columns
                                           of I): BI gate rows and the BI matching up rows streamed
                                           once, the clamped SwiGLU in registers → (n·KS, I)
    out[t] = Σ_j w[t, j] · act[s] @ down[e]ᵀ   one program per (token, BH output columns): the k
                                           experts' (and the shared expert's) down rows, fp32 sum

Slot ``j == k`` is the shared expert (weight 1) when ``shared`` is given, so the MoE block is two
launches; ``shared_act`` computes the shared slot's SwiGLU rows alone, before the routing (the
static decode runs it on a side stream next to the router), and ``moe_gemv(..., act=)`` then runs
the routed slots only. H200, one V4-Flash layer at batch 1 (6 experts + shared, 352 MB): ~100 µs
(3.5 TB/s) against 188 µs for the grouped path and three shared-expert GEMVs (NOTES run 12). Roundings as ``moe_experts`` + the shared expert: the gate/up and down products rounded
to the input dtype (as a GEMM writes them), the weighted sum in fp32 and rounded once (as
``combine_rows`` with ``add``). Weights in ``engine.model.moe.Experts``' layout: ``gate_up (E, 2I, H)``
(rows ``[:I]`` gate), ``down (E, H, I)``; the shared expert's ``(I, H)``, ``(I, H)``, ``(H, I)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._common import HAS_TRITON, even_tile, tl, triton, use_triton
from kernels.moe import _RND, moe_experts_reference

GemvConfig = tuple[int, int, int]  # (rows per program, K block, num_warps)


@dataclass(frozen=True)
class MoEGemvTuning:
    """When static decode takes this path, and its launch configs.

    ``max_slots``: at most this many routed slots (n·k) take it; more rows re-read fewer distinct
    experts per row and the grouped GEMM path wins. 192 (NOTES runs 34-37, H200, V4 slice, 6
    picks): against 16, plain decode b=3/4/5/8 2.87/2.82/3.57/4.28 → 2.14/2.12/3.04/3.26 ms and
    the b=1 verify of k=2/3 2.32/2.60 → 1.71/2.00 ms; against 64, b=12/16 5.78/6.49 → 5.14/5.32
    ms; a 24-slot bucket (144 pairs) 7.92 → 7.03 ms against 128, b=32 (192 pairs) 9.81 → 9.15 ms
    against 160, the b=16 k=1 verify (192 pairs) 10.28 → 9.37 ms; 288 pairs tie (the b=16 k=2
    verify 12.61 / 12.75 ms), 384 lose (k=3 14.34 → 16.54 ms); b=1 unchanged. ``fp4_max_slots``:
    the limit for the checkpoint's FP4 experts (``kernels.moe_fp4_gemv``), whose GEMV reads every
    slot's expert whole (no gain from slots sharing an expert): 24. Run 76 (H100, V4-Flash experts,
    the whole routed MoE, ``python -m bench.fp4_experts_bench``): 6 / 24 / 96 slots 66.3 / 229.3 /
    839.7 µs against 122.5 / 231.0 / 631.1 on the grouped kernel (bf16 codes decoded in pairs):
    the two tie at 24. Between 24 and 96 slots is not measured. ``up``/``down``: ``GemvConfig`` of the gate/up
    and the down kernel; the microbench (``python -m bench.moe_gemv_sweep``) sweeps them. None
    (the default): 4 rows a program, 4 warps, a 1024-column K block where it divides the hidden
    size (gate/up) or the intermediate size (down), else ``_common.even_tile``'s (V4.1's 2304:
    256, not a 1024 block ending a quarter full).
    """

    max_slots: int = 192
    fp4_max_slots: int = 24
    up: GemvConfig | None = None
    down: GemvConfig | None = None


MOE_GEMV = MoEGemvTuning()  # the default

Shared = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate (I, H), up (I, H), down (H, I)


def resolved(cfg: GemvConfig | None, k: int) -> GemvConfig:
    """``cfg``, or for None the default for a K of ``k`` columns (``MoEGemvTuning``)."""
    return cfg or (4, even_tile(k, 1024), 4)


def use_gemv(x: torch.Tensor, slots: int, tuning: MoEGemvTuning = MOE_GEMV) -> bool:
    """Whether ``moe_gemv`` should run ``slots`` routed (token, expert) pairs of ``x``: a few
    (``tuning.max_slots``), with Triton available."""
    return use_triton(x) and slots <= tuning.max_slots


def moe_gemv_reference(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    limit: float, shared: Shared | None = None,
) -> torch.Tensor:  # fmt: skip
    """The routed experts (``moe_experts_reference``) plus the shared expert's SwiGLU MLP."""
    out = moe_experts_reference(x, weights, indices, gate_up, down, limit)
    if shared is None:
        return out
    sg, su, sd = shared
    gate, up = F.linear(x, sg), F.linear(x, su)
    return out + F.linear(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit), sd)


def moe_gemv(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    limit: float, shared: Shared | None = None, *, act: torch.Tensor | None = None, tuning: MoEGemvTuning = MOE_GEMV,
) -> torch.Tensor:  # fmt: skip
    """``x (N, H)``, ``weights (N, k)`` fp32, ``indices (N, k)`` → ``(N, H)`` (module docstring);
    ``shared`` (same ``limit``) is added as slot ``k`` with weight 1. ``act``: the SwiGLU rows of
    ``shared_act`` (computed before the routing, e.g. on another stream): only the routed slots'
    gate/up run here. No host sync."""
    if not use_triton(x):
        return moe_gemv_reference(x, weights, indices, gate_up, down, limit, shared)
    n, hidden = x.shape
    k = indices.shape[1]
    inter = gate_up.shape[1] // 2
    ks = k + (shared is not None)
    assert x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    sg, su, sd = shared if shared is not None else (gate_up, gate_up, down)
    assert sg.is_contiguous() and su.is_contiguous() and sd.is_contiguous()
    idx, w = indices.contiguous(), weights.contiguous()
    out = torch.empty_like(x)
    if n == 0:
        return out
    if act is None:
        act = torch.empty(n * ks, inter, dtype=x.dtype, device=x.device)
        _launch_up(x, idx, gate_up, sg, su, act, k, ks, limit, 0, tuning.up)
    else:
        assert shared is not None and act.shape == (n * ks, inter)
        _launch_up(x, idx, gate_up, sg, su, act, k, ks, limit, 1, tuning.up)
    bh, bk, warps = resolved(tuning.down, inter)
    _gemv_down_kernel[(n, triton.cdiv(hidden, bh))](
        act, idx, w, down, sd, out, hidden, inter, down.stride(0), out.stride(0),
        K=k, KS=ks, BH=bh, BK=bk, RND=_RND.get(x.dtype, 0), num_warps=warps,
    )  # fmt: skip
    return out


def shared_act(x: torch.Tensor, shared: Shared, k: int, limit: float, tuning: MoEGemvTuning = MOE_GEMV) -> torch.Tensor:
    """The ``act`` buffer ``(N·(k+1), I)`` of ``moe_gemv`` with the shared expert's SwiGLU rows
    (slot ``k`` of each token) filled: it needs no routing, so it can run next to the router."""
    n = x.shape[0]
    act = torch.empty(n * (k + 1), shared[0].shape[0], dtype=x.dtype, device=x.device)
    if n:
        _launch_up(x, x, shared[0], shared[0], shared[1], act, k, k + 1, limit, 2, tuning.up)
    return act


def _launch_up(x, idx, gate_up, sg, su, act, k: int, ks: int, limit: float, mode: int, cfg: GemvConfig | None) -> None:
    """The gate/up kernel over every slot (mode 0), the routed slots (1) or the shared slot (2)."""
    n, hidden = x.shape
    inter = act.shape[1]
    bi, bk, warps = resolved(cfg, hidden)
    rows = (n * ks, n * k, n)[mode]
    _gemv_up_kernel[(rows, triton.cdiv(inter, bi))](
        x, idx, gate_up, sg, su, act, hidden, inter, x.stride(0), gate_up.stride(0), float(limit),
        K=k, KS=ks, BI=bi, BK=bk, RND=_RND.get(x.dtype, 0), MODE=mode, num_warps=warps,
    )  # fmt: skip


if HAS_TRITON:
    from kernels.moe import _round_to

    @triton.jit
    def _gemv_up_kernel(
        x_ptr, idx_ptr, gu_ptr, sg_ptr, su_ptr, act_ptr, H, I, stride_x, stride_e, limit,
        K: tl.constexpr, KS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, RND: tl.constexpr,
        MODE: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0)
        if MODE == 0:  # every slot
            t = p // KS
            j = p % KS
        elif MODE == 1:  # the routed slots
            t = p // K
            j = p % K
        else:  # the shared slot
            t = p
            j = K
        s = t * KS + j  # row of act
        rows = tl.program_id(1) * BI + tl.arange(0, BI)
        r_ok = rows < I
        if j < K:
            e = tl.load(idx_ptr + t * K + j).to(tl.int64)
            g_base = gu_ptr + e * stride_e
            u_base = g_base + I * H
        else:  # the shared expert
            g_base = sg_ptr
            u_base = su_ptr
        row_off = rows.to(tl.int64)[:, None] * H
        cols = tl.arange(0, BK)
        acc_g = tl.zeros([BI, BK], dtype=tl.float32)
        acc_u = tl.zeros([BI, BK], dtype=tl.float32)
        x_row = x_ptr + t.to(tl.int64) * stride_x
        for k0 in range(0, H, BK):
            c = k0 + cols
            c_ok = c < H
            xv = tl.load(x_row + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            m = r_ok[:, None] & c_ok[None, :]
            acc_g += tl.load(g_base + row_off + c[None, :], mask=m, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(u_base + row_off + c[None, :], mask=m, other=0.0).to(tl.float32) * xv
        gate = tl.minimum(_round_to(tl.sum(acc_g, axis=1), RND), limit)
        up = tl.minimum(tl.maximum(_round_to(tl.sum(acc_u, axis=1), RND), -limit), limit)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + s.to(tl.int64) * I + rows, act.to(act_ptr.dtype.element_ty), mask=r_ok)

    @triton.jit
    def _gemv_down_kernel(
        act_ptr, idx_ptr, w_ptr, dn_ptr, sd_ptr, out_ptr, H, I, stride_e, stride_o,
        K: tl.constexpr, KS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, RND: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        rows = tl.program_id(1) * BH + tl.arange(0, BH)
        r_ok = rows < H
        row_off = rows.to(tl.int64)[:, None] * I
        cols = tl.arange(0, BK)
        total = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(KS):
            if j < K:
                e = tl.load(idx_ptr + t * K + j).to(tl.int64)
                base = dn_ptr + e * stride_e
                wj = tl.load(w_ptr + t * K + j).to(tl.float32)
            else:  # the shared expert, weight 1
                base = sd_ptr
                wj = 1.0
            a_row = act_ptr + (t * KS + j).to(tl.int64) * I
            acc = tl.zeros([BH, BK], dtype=tl.float32)
            for k0 in range(0, I, BK):
                c = k0 + cols
                c_ok = c < I
                a = tl.load(a_row + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                wt = tl.load(base + row_off + c[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
                acc += wt.to(tl.float32) * a
            total += wj * _round_to(tl.sum(acc, axis=1), RND)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + rows, total.to(out_ptr.dtype.element_ty), mask=r_ok)
