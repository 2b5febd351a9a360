"""DeepSeek-V4 MoE on the GPU: fused routing and grouped expert GEMMs.

Routing (``route``), one Triton program per ``BLOCK_N`` tokens, all ``E`` logits in registers::

    scores  = sqrtsoftplus(logits)            (rounded to the logits' dtype, as the model does)
    indices = top-k(scores + correction_bias)  (score routing)   or  tid2eid[token_ids]  (hash routing)
    weights = scores[indices] / Σ · routed_scaling_factor          → (N, k) fp32, (N, k) int64

``logits = x @ gate.weightᵀ`` stays a cuBLAS GEMM outside. Experts (``moe_experts``)::

    sort the N·k (token, expert) pairs by expert       (argsort, scatter-add counts → int32 offsets)
    h = x[token] @ gate_up[e]ᵀ                         torch._grouped_mm, bf16   (N·k, 2I)
    a = silu(min(h_gate, L)) · clamp(h_up, -L, L)      Triton                    (N·k, I)
    y = a @ down[e]ᵀ                                   torch._grouped_mm         (N·k, H)
    out[n] = Σ_j weights[n, j] · y[slot(n, j)]         Triton, fp32 sum, no atomics  (N, H)

Weights are transformers' stacked layout: ``gate_up (E, 2I, H)`` (rows ``[:I]`` gate, ``[I:]`` up),
``down (E, H, I)``; ``weights (N, k)`` and ``indices (N, k)`` as ``route`` returns them. Where
``torch._grouped_mm`` is missing or the dtype is not bf16 (fp32 tests), the GEMMs run as one
``F.linear`` per non-empty expert over the same sorted rows (a host sync for the counts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.reference import score
from kernels._common import HAS_TRITON, next_pow2, tl, triton, use_triton

if TYPE_CHECKING:  # kernels.moe_grouped imports this module
    from kernels.moe_grouped import GroupedMoETuning

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
_RND = {torch.bfloat16: 1, torch.float16: 2}  # the route kernel's rounding of scores


# ---- routing ------------------------------------------------------------------------------------
def route_reference(
    logits: torch.Tensor,
    top_k: int,
    scaling: float,
    bias: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    scoring_func: str = "sqrtsoftplus",
    temp: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Router.forward`` after its gate GEMM. → weights ``(N, k)`` fp32, indices ``(N, k)`` int64.
    ``temp``: the logits divided by it before scoring (V4.1's ``gate_temp``); ``normalize``: the
    picked scores divided by their sum (V4.1 without ``norm_topk_prob`` or at k = 1: not)."""
    scores = score(logits if temp == 1.0 else logits / temp, scoring_func)  # (N, E) in the logits' dtype
    if tid2eid is not None:
        indices = tid2eid[token_ids].long()
    else:
        indices = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).float(), indices


def route(
    logits: torch.Tensor,
    top_k: int,
    scaling: float,
    bias: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    scoring_func: str = "sqrtsoftplus",
    temp: float = 1.0,
    normalize: bool = True,
    *,
    block_n: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused routing: score routing (``bias`` given) or hash routing (``tid2eid``, ``token_ids``).

    ``logits (N, E)``; ``bias (E,)`` fp32 correction bias (selection only); ``tid2eid (V, k)``;
    ``temp`` and ``normalize`` as ``route_reference`` (the division correctly rounded, as torch's).
    Ties in ``scores + bias`` go to the lower expert id; score-routed picks come in descending
    ``scores + bias`` (``torch.topk``'s sorted order). → ``(N, k)`` fp32 weights, int64 indices.
    """
    hashed = tid2eid is not None
    assert hashed or bias is not None, "score routing needs the correction bias"
    if not use_triton(logits) or scoring_func not in SCORING_FUNCS:
        return route_reference(logits, top_k, scaling, bias, tid2eid, token_ids, scoring_func, temp, normalize)
    n, e = logits.shape
    assert logits.stride(-1) == 1
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, indices
    dummy = torch.empty(1, dtype=torch.int64, device=logits.device)  # never read (no fill launch)
    # at most 4096 scores a program (past it the (rows, E) tiles spill: 46 µs a call at 1 × 512 padded experts in 16-row blocks)
    block_n = max(1, min(block_n, 4096 // next_pow2(e), next_pow2(n)))
    _route_kernel[(triton.cdiv(n, block_n),)](
        logits, bias if bias is not None else logits, tid2eid.contiguous() if hashed else dummy,
        token_ids if hashed else dummy, weights, indices,
        n, e, logits.stride(0), float(scaling), float(temp),
        E_PAD=next_pow2(e), K=top_k, K_PAD=next_pow2(top_k), BLOCK_N=block_n,
        FUNC=SCORING_FUNCS.index(scoring_func), HASH=hashed, RND=_RND.get(logits.dtype, 0),
        TEMP=temp != 1.0, NORM=normalize, num_warps=4,
    )  # fmt: skip
    return weights, indices


# ---- experts ------------------------------------------------------------------------------------
def moe_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``Experts.forward`` of ``engine.model.moe``: one F.linear pair per non-empty expert."""
    out = torch.zeros_like(x)  # (N, H)
    flat = indices.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // indices.shape[1]
    slot_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tok = token_of[start : start + count]
        gate, up = F.linear(x[tok], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit), down[expert])
        out.index_add_(0, tok, (y * slot_weights[start : start + count, None]).to(out.dtype))
        start += count
    return out


def has_grouped_mm(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def grouped_linear(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows ``xs (M, K)`` sorted by group, group g = rows ``[offs[g-1], offs[g])`` times ``w[g]ᵀ``:
    ``torch._grouped_mm`` on CUDA in bf16, else one ``F.linear`` per non-empty group (a host sync
    for ``counts``)."""
    if xs.is_cuda and has_grouped_mm(xs.dtype):
        return torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs)  # (M, out)
    out = xs.new_empty(xs.shape[0], w.shape[1])
    start = 0
    for g, c in enumerate(counts.tolist()):
        if c:
            out[start : start + c] = F.linear(xs[start : start + c], w[g])
        start += c
    return out


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    add: torch.Tensor | None = None,
    grouped: GroupedMoETuning | None = None,
) -> torch.Tensor:
    """Routed experts' weighted sum ``(N, H)`` (layout in the module docstring), plus ``add (N, H)``
    (the shared expert's output) when given: summed in fp32 by the combine kernel, rounded once.
    ``grouped``: when and how prefill sizes take ``kernels.moe_grouped`` (None: its defaults)."""
    if not use_triton(x):
        out = moe_experts_reference(x, weights, indices, gate_up, down, limit)
        return out if add is None else out + add
    from kernels import moe_grouped

    grouped = grouped or moe_grouped.GROUPED_MOE
    if moe_grouped.use_prefill_gemm(x, indices, grouped):  # prefill sizes: Triton grouped GEMM, SwiGLU fused
        return moe_grouped.moe_experts_prefill(x, weights, indices, gate_up, down, limit, add, grouped)
    return grouped_experts(
        x, weights, indices, gate_up.shape[0], gate_up.shape[1] // 2, limit,
        lambda xs, offs, counts: grouped_linear(xs, gate_up, offs, counts),
        lambda act, offs, counts: grouped_linear(act, down, offs, counts), add=add,
    )  # fmt: skip


GroupedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    n_exp: int,
    inter: int,
    limit: float,
    up: GroupedLinear,
    down: GroupedLinear,
    fused_act: bool = False,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed-expert pipeline around two grouped GEMMs (bf16 ``moe_experts``, FP8
    ``moe_experts_fp8``): slots sorted by expert, ``up`` (gate/up) and ``down`` on the grouped
    rows — each called as ``(rows, group end offsets, group counts)`` — the fused SwiGLU between
    them (``fused_act``: ``up`` returns the SwiGLU itself) and the weighted combine after (plus
    ``add``, see ``combine_rows``). No host
    sync anywhere (CUDA-graph capturable: CUDA bincount reads max() on the host, a scatter_add of
    ones does not)."""
    k = indices.shape[1]
    flat = indices.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)  # (N*k,) sorted slot -> flat (token, j) slot
    counts = torch.zeros(n_exp, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) group end offsets
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))  # flat slot -> sorted row
    xs = x.index_select(0, order // k)  # (N*k, H) tokens grouped by expert
    h = up(xs, offs, counts)  # (N*k, 2I), or the SwiGLU (N*k, I) already with fused_act
    act = h if fused_act else swiglu_rows(h, limit)  # (N*k, I)
    return combine_rows(down(act, offs, counts), inv, weights, x, add)


def swiglu_rows(h: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU of rows ``h (M, 2I)`` (gate | up) → ``(M, I)`` (Triton)."""
    inter = h.shape[1] // 2
    act = torch.empty(h.shape[0], inter, dtype=h.dtype, device=h.device)
    if h.shape[0]:
        block = min(1024, next_pow2(inter))
        _swiglu_kernel[(h.shape[0], triton.cdiv(inter, block))](
            h, act, inter, h.stride(0), act.stride(0), float(limit), BLOCK=block, num_warps=4
        )
    return act


def combine_rows(
    y: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = Σ_j weights[t, j] · y[row_of_slot[t·k + j]]`` (fp32 sum in ``j`` order, Triton),
    ``+ add[t]`` in the same fp32 sum when given (one pass instead of a separate add) → ``(N, H)`` like ``x``."""
    n, hidden = x.shape
    out = torch.empty_like(x)
    if add is not None:
        assert add.shape == x.shape and add.stride(-1) == 1
    if n:
        block = min(1024, next_pow2(hidden))
        _combine_kernel[(n, triton.cdiv(hidden, block))](
            y, row_of_slot, weights, out, add if add is not None else out, hidden, y.stride(0), weights.stride(0), out.stride(0),
            add.stride(0) if add is not None else 0, K=weights.shape[1], BLOCK=block, ADD=add is not None, num_warps=4,
        )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def _round_to(x, RND: tl.constexpr):
        """fp32 ``x`` rounded to the logits' dtype (RND 1: bf16, 2: fp16, 0: fp32) and back, as a
        torch op in that dtype rounds its result. bf16 by integer round-to-nearest-even (the CPU
        interpreter's own cast truncates)."""
        if RND == 1:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits
            out = bits.to(tl.float32, bitcast=True)
        elif RND == 2:
            out = x.to(tl.float16).to(tl.float32)
        else:
            out = x
        return out

    @triton.jit
    def _route_kernel(
        logits_ptr, bias_ptr, tid2eid_ptr, tok_ptr, w_ptr, idx_ptr,
        N, E, stride_l, scaling, temp,
        E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        FUNC: tl.constexpr, HASH: tl.constexpr, RND: tl.constexpr, TEMP: tl.constexpr, NORM: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        cols = tl.arange(0, E_PAD)  # (E_PAD,)
        kc = tl.arange(0, K_PAD)  # (K_PAD,)
        r_ok = rows < N
        c_ok = cols < E
        x = tl.load(
            logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
            mask=r_ok[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)  # (BLOCK_N, E_PAD)
        if TEMP:
            x = _round_to(tl.math.div_rn(x, temp + tl.zeros_like(x)), RND)
        if FUNC == 0:  # sqrtsoftplus; softplus = max(x, 0) + log1p(exp(-|x|)), log1p kept accurate
            u = tl.exp(-tl.abs(x))
            v = 1.0 + u
            log1p = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
            sp = _round_to(tl.maximum(x, 0.0) + log1p, RND)
            s = _round_to(tl.sqrt(sp), RND)
        else:  # sigmoid
            s = _round_to(1.0 / (1.0 + tl.exp(-x)), RND)
        wk = tl.zeros([BLOCK_N, K_PAD], dtype=tl.float32)
        if HASH:
            tok = tl.load(tok_ptr + rows, mask=r_ok, other=0).to(tl.int64)
            ik = tl.load(tid2eid_ptr + tok[:, None] * K + kc[None, :], mask=r_ok[:, None] & (kc < K)[None, :], other=0)
            ik = ik.to(tl.int32)
            for i in tl.static_range(K):
                e_i = tl.sum(tl.where(kc[None, :] == i, ik, 0), axis=1)  # (BLOCK_N,)
                w_i = tl.sum(tl.where(cols[None, :] == e_i[:, None], s, 0.0), axis=1)
                wk = tl.where(kc[None, :] == i, w_i[:, None], wk)
        else:
            ik = tl.zeros([BLOCK_N, K_PAD], dtype=tl.int32)
            b = tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
            sel = tl.where(c_ok[None, :], s + b[None, :], float("-inf"))
            for i in tl.static_range(K):
                m = tl.max(sel, axis=1)  # (BLOCK_N,)
                e_i = tl.min(tl.where(sel == m[:, None], cols[None, :], E_PAD), axis=1)  # lowest id on ties
                hit = cols[None, :] == e_i[:, None]
                w_i = tl.sum(tl.where(hit, s, 0.0), axis=1)
                sel = tl.where(hit, float("-inf"), sel)
                wk = tl.where(kc[None, :] == i, w_i[:, None], wk)
                ik = tl.where(kc[None, :] == i, e_i[:, None], ik)
        if NORM:
            wk = wk / (tl.sum(wk, axis=1)[:, None] + 1e-20)
        wk = wk * scaling
        out_mask = r_ok[:, None] & (kc < K)[None, :]
        out_off = rows.to(tl.int64)[:, None] * K + kc[None, :]
        tl.store(w_ptr + out_off, wk, mask=out_mask)
        tl.store(idx_ptr + out_off, ik.to(tl.int64), mask=out_mask)

    @triton.jit
    def _swiglu_kernel(h_ptr, out_ptr, I, stride_h, stride_o, limit, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        gate = tl.load(h_ptr + row * stride_h + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_h + I + offs, mask=ok, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + offs, act.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_kernel(
        y_ptr, inv_ptr, w_ptr, out_ptr, add_ptr, H, stride_y, stride_w, stride_o, stride_a,
        K: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if ADD:
            acc += tl.load(add_ptr + n * stride_a + offs, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + n * K + j).to(tl.int64)
            wj = tl.load(w_ptr + n * stride_w + j).to(tl.float32)
            acc += wj * tl.load(y_ptr + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_cost(n_tokens: int, top_k: int, experts_touched: int, hidden: int, inter: int, elem: int = 2) -> tuple[float, float]:
    """Fewest bytes (touched experts' weights once, activations in/out) and FLOPs of the routed experts."""
    nbytes = elem * (experts_touched * 3 * hidden * inter + 2 * n_tokens * hidden)
    flops = 2.0 * n_tokens * top_k * 3 * hidden * inter
    return nbytes, flops
