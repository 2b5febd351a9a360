"""DeepSeek-V4.1's fast path: the general path's math without its (T × T) tensors and Python loops.

The general path (``attention.py``, ``layers.py``) is the reference: a dense masked softmax over
[window ring, every new key, every compressed row] per tile of queries, the indexer's
``(s, Hi, T)`` fp32 logits, one Python iteration (and host sync) per routed expert, ~100 small ops
per mHC site for the Sinkhorn. Where ``V41Tuning.fast`` says so (default: on CUDA) the model
takes these instead, on the same values:

- attention: ``kernels.prefill.prefill_attention`` (V4's flash kernel over a per-query virtual key
  list, the same softmax with the sink only in the denominator): each query's ``W`` window keys as
  a strided view of the left-padded ``[ring, new keys]``, and only its chosen compressed rows
  (``row_idx``, ``-1`` = none), never a score matrix; the output's inverse RoPE in its epilogue;
- indexer scores: ``kernels.indexer.indexer_scores_prefill`` (relu, weighted head sum and the
  causal ``-inf`` in one kernel; the ``(s, Hi, T)`` logits never reach memory), level one of the
  top-k as the general path, level two in one launch (``kernels.topk.row_topk``: ``torch.topk``'s
  set on CUDA, ties to the lowest row; the CPU keeps ``torch.topk``);
- mHC: the gates' input norm and projection as V4's blocked dots over the raw streams
  (``kernels.prefill.hc_pre_block_parts``: the norm applied after the projection, where it
  commutes) and the gates and Sinkhorn in one kernel (``kernels.mhc.hc_mix_parts``); the collapse
  with the block's RMSNorm and the expand in one pass each (``kernels.v41_mhc``);
- router: after its fp32 logits one ``kernels.moe.route`` launch (``routed``);
- routed experts: over the layer's stacked weights (``MoE.stack``), tokens sorted by expert, one
  grouped GEMM per projection (``torch._grouped_mm`` in bf16 on CUDA, then the weighted SwiGLU in
  one pass, ``kernels.v41_moe``; on Hopper, or where ``V41Tuning.expert_gemm`` gives configs,
  ``kernels.moe_grouped``'s Triton GEMM with that SwiGLU in its gate|up epilogue) and the
  per-token sum in one pass (``kernels.v41_moe``), all in ``MoE.forward``'s own rounding order:
  the routing weight before the down projection, the picks summed in ascending expert order, then
  the shared expert. (``kernels.moe.moe_experts`` applies
  the weight after the down projection: same math, other last bits, and on these models a last
  bit that moves one FP8/FP4 KV rounding or one top-k pick moves later logits by far more than
  1e-4.)

Off CUDA without the Triton interpreter every kernel above runs its PyTorch reference, so the
fast path's torch parts are testable on the CPU (there the MoE gives the general path's bits).
The attention, indexer and mHC kernels sum in another order than the general path, so fp32
results agree to the last bits, not bitwise; where such a bit moves one FP8/FP4 rounding or one
top-k pick, later logits move by more (tests: the fixtures' greedy tokens and logprobs within
1e-4, the knife-edge prompts within their bar, as for the general path on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.model.v41.layers import HyperSite, MoE, RMSNorm, Router, collapse, expand, linear_fp32
from kernels import v41_mhc
from kernels._common import use_triton
from kernels.indexer import indexer_scores_prefill
from kernels.mhc import hc_mix, hc_mix_parts
from kernels.moe import SCORING_FUNCS, grouped_linear, has_grouped_mm, route
from kernels.moe_grouped import GemmConfig, grouped_mm
from kernels.v41_moe import combine_in_order, weighted_swiglu
from kernels.prefill import AttentionTuning, hc_pre_block_parts, prefill_attention


ExpertGemm = tuple[GemmConfig | None, GemmConfig | None]  # gate|up, down (see V41Tuning.expert_gemm)
TORCH_GEMMS: ExpertGemm = (None, None)
# the H200 sweep at V4.1-Flash's shapes, 8K tokens (NOTES run 59): gate|up + weighted SwiGLU
# 5.57 ms with 32-row tail tiles (6.29 without; 8.14 for torch._grouped_mm + weighted_swiglu),
# down 2.81 with 64-row tails (3.00 without, 4.41 torch)
HOPPER_GEMMS: ExpertGemm = ((128, 128, 64, 8, 4, 32), (128, 256, 64, 8, 4, 64))


def expert_gemms(choice: ExpertGemm | None, x: torch.Tensor) -> ExpertGemm:
    """``V41Tuning.expert_gemm`` for rows on ``x``'s device: the choice, or (None) ``HOPPER_GEMMS``
    on a Hopper GPU (the configs need its shared memory) and the torch GEMMs elsewhere."""
    if choice is not None:
        return choice
    return HOPPER_GEMMS if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 else TORCH_GEMMS


def use_fast(flag: bool | None, t: torch.Tensor) -> bool:
    """``V41Tuning.fast`` for a tensor: the flag, or (None) whether ``t`` is on CUDA."""
    return t.is_cuda if flag is None else flag


def window_attention(
    q: torch.Tensor, ring: torch.Tensor, kv: torch.Tensor, window: int, sinks: torch.Tensor, scale: float,
    rows: torch.Tensor | None, picks: tuple[torch.Tensor, torch.Tensor] | None, rope: tuple[torch.Tensor, torch.Tensor],
    tuning: AttentionTuning | None = None,
) -> torch.Tensor:  # fmt: skip
    """``Attention._attend`` of one chunk without a mask tensor, then the inverse RoPE of
    ``rope = (cos, sin)`` (``(S, R/2)``, the queries' tables) in the kernel's epilogue:
    ``q (S, nh, D)`` over its window of ``[ring (R, D), kv (S, D)]`` and the chosen ``rows (T, D)``
    (``picks``: indices ``(S, k)`` and True where valid; None: no row visible) → ``(S, nh, D)`` in
    q's dtype; ``tuning``: the kernel's launch (None: ``prefill_attention``'s choice)."""
    s, r = q.shape[0], ring.shape[0]
    pad = window - 1 - r
    assert pad >= 0, f"ring of {r} rows, window {window}"
    keys = torch.cat([kv.new_zeros(pad, kv.shape[1]), ring, kv])  # (W-1+S, D): pad rows never read
    if rows is None or picks is None or not rows.shape[0]:
        out = prefill_attention(q, keys, pad, sinks, window, scale=scale, rope=rope, fold_q=0, tuning=tuning)
    else:
        idx, valid = picks
        row_idx = torch.where(valid, idx, -1).to(torch.int32)  # (S, k)
        row_len = torch.full((s,), rows.shape[0], dtype=torch.int32, device=q.device)
        out = prefill_attention(q, keys, pad, sinks, window, rows, row_len, row_idx, scale=scale, rope=rope, fold_q=0, tuning=tuning)
    return out.to(q.dtype)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, complete: torch.Tensor, scale: float) -> torch.Tensor:
    """``Indexer.select``'s scores of one tile: ``Σ_h weights[:, h] · relu(q_h · k) · scale`` of ``q (s, Hi,
    Di)`` against ``keys (T, Di)``, ``-inf`` from ``complete (s,)`` on → ``(s, T)`` fp32."""
    t = keys.shape[0]
    return indexer_scores_prefill(q.contiguous(), weights.contiguous(), keys.contiguous(), complete.clamp(max=t).to(torch.int32), scale, t)


def gates(site: HyperSite, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``HyperSite.gates`` through the kernels (module docstring) → ``pre, post (N, hc)``, ``comb (N, hc, hc)``."""
    if use_triton(streams):
        parts = hc_pre_block_parts(streams, site.fn.float().contiguous())  # (N, splits, MP): fn @ x and Σx²
        return hc_mix_parts(parts, streams.shape[1] * streams.shape[2], site.norm_eps, site.scale, site.base, site.hc, site.iters, site.hc_eps)
    flat = streams.flatten(1).float()  # (N, hc·H), normalised as one vector per token
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + site.norm_eps)
    return hc_mix(F.linear(flat, site.fn.float()), site.scale, site.base, site.hc, site.iters, site.hc_eps)


def collapse_norm(pre: torch.Tensor, streams: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(collapse(pre, streams))`` in one pass (``kernels.v41_mhc``)."""
    return v41_mhc.collapse_norm(pre, streams, norm.weight, norm.eps)


def routed(gate: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Router.forward`` of ``x (N, H)``: after the fp32 logits, where Triton runs, the scores,
    bias, top-k, weights and their normalisation in one launch (``kernels.moe.route``, as the slot
    decoder: the same math, ties to the lower expert) instead of ``Router.route``'s dozen."""
    logits = linear_fp32(x, gate.weight)  # (N, E)
    if not use_triton(x) or gate.scoring_func not in SCORING_FUNCS:
        return gate.route(logits)
    return route(logits, gate.top_k, gate.scaling, gate.bias, scoring_func=gate.scoring_func, temp=gate.temp, normalize=gate.normalize)


def moe(layer: MoE, x: torch.Tensor, expert_gemm: ExpertGemm | None = None) -> torch.Tensor:
    """``MoE.forward`` of ``x (N, H)`` with grouped expert GEMMs in its rounding order → ``(N, H)``.

    The (token, pick) slots sorted by expert (tokens ascending inside an expert: the rows the
    general path hands each expert), one grouped GEMM for gate|up and one for down; between them
    ``weight · silu(gate) · up`` in fp32 as ``Expert.forward``; each token's outputs summed in fp32 in
    ascending expert order, then the shared expert's (``_shared_expert``), as ``MoE.forward``. ``expert_gemm``: the
    Triton launch configs of the bf16 GEMMs (``V41Tuning.expert_gemm``, ``expert_gemms``)."""
    weights, indices = routed(layer.gate, x)  # (N, k) each
    indices, order = indices.sort(dim=-1)  # a token's picks in ascending expert order
    weights = weights.gather(1, order)
    gate_up, down = layer.stack()
    n, k = indices.shape
    flat = indices.reshape(-1)  # (N·k,)
    slots = torch.argsort(flat, stable=True)  # sorted row -> flat (token, j) slot
    counts = torch.zeros(gate_up.shape[0], dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) group end offsets
    up_cfg, down_cfg = expert_gemms(expert_gemm, x)
    src, w, limit = slots // k, weights.reshape(-1)[slots], layer.shared_experts.limit  # (N·k,) token of each sorted row, its weight
    if _triton_gemm(x, up_cfg):  # the weighted SwiGLU in the epilogue, the rows gathered by the loads
        act = grouped_mm(x, gate_up, offs, swiglu_limit=limit, row_weight=w.float(), rows=src, cfg=up_cfg)  # (N·k, I)
    else:
        act = _weighted_act(x.index_select(0, src), w, gate_up, offs, counts, limit)
    if _triton_gemm(act, down_cfg):
        y = grouped_mm(act, down, offs, cfg=down_cfg)  # (N·k, H)
    else:
        y = grouped_linear(act, down, offs, counts)
    row_of_slot = torch.empty_like(slots).scatter_(0, slots, torch.arange(slots.numel(), device=x.device))
    return combine_in_order(y, row_of_slot, k, _shared_expert(layer, x))


def _shared_expert(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """``layer.shared_experts(x)``: on CUDA its gate and up as one GEMM and the SwiGLU in one
    kernel (``weighted_swiglu`` with unit weights: ``Expert.forward``'s roundings), else the module."""
    se = layer.shared_experts
    if not x.is_cuda:
        return se(x)
    act = weighted_swiglu(F.linear(x, layer.shared_gate_up()), torch.ones(x.shape[0], device=x.device), se.limit)  # (N, I)
    return se.w2(act)


def _triton_gemm(xs: torch.Tensor, cfg: GemmConfig | None) -> bool:
    """Whether a grouped GEMM of ``xs`` takes ``grouped_mm``: a config given whose K block divides
    the rows' width, and bf16 rows on CUDA (or under the interpreter); fp32 keeps its torch path,
    bit for bit."""
    return cfg is not None and xs.dtype == torch.bfloat16 and use_triton(xs) and xs.shape[1] % cfg[2] == 0


def _weighted_act(xs: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor, limit: float) -> torch.Tensor:
    """``w · silu(gate) · up`` of the sorted rows ``xs (M, H)`` → ``(M, I)`` (``kernels.v41_moe``)
    through the torch GEMMs: one grouped GEMM for gate|up where ``grouped_linear`` takes
    ``torch._grouped_mm``, else the gate and up halves as separate GEMMs per expert (``Expert``'s
    own ``w1`` and ``w3`` calls, their last bits included)."""
    if xs.is_cuda and has_grouped_mm(xs.dtype):
        return weighted_swiglu(grouped_linear(xs, gate_up, offs, counts), w, limit)
    inter = gate_up.shape[1] // 2
    h = torch.cat([grouped_linear(xs, gate_up[:, :inter], offs, counts), grouped_linear(xs, gate_up[:, inter:], offs, counts)], dim=-1)  # (M, 2I)
    return weighted_swiglu(h, w, limit)


class LayerOps(NamedTuple):
    """The token-wise steps of a decoder layer: the general path's or the fast path's."""

    gates: Callable[[HyperSite, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    collapse_norm: Callable[[torch.Tensor, torch.Tensor, RMSNorm], torch.Tensor]
    expand: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    moe: Callable[[MoE, torch.Tensor, ExpertGemm], torch.Tensor]


def _general_moe(layer: MoE, x: torch.Tensor, expert_gemm: ExpertGemm | None = None) -> torch.Tensor:
    """``MoE.forward`` (its per-expert loop takes no GEMM configs)."""
    return layer(x)


GENERAL = LayerOps(HyperSite.gates, lambda pre, streams, norm: norm(collapse(pre, streams)), expand, _general_moe)
FAST = LayerOps(gates, collapse_norm, v41_mhc.expand, moe)
