"""DeepSeek-V4 mixture of experts: score-routed or hash-routed top-k experts plus a shared expert.

Score routing: ``scores = sqrtsoftplus(x Wᵀ)``; experts chosen by ``top-k(scores + bias)``;
weights = chosen scores normalised to sum 1, times ``routed_scaling_factor``.
Hash routing (the first layers): the experts come from a frozen ``tid2eid[token_id]`` table;
the weights are computed the same way from the learned gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import cpu_fused
from engine.model.config import ModelConfig
from engine.model.layers import SharedMLP, swiglu
from kernels.moe_fp4 import Fp4PrefillTuning
from kernels.moe_grouped import GroupedMoETuning
from kernels.reference import score


@dataclass(frozen=True)
class MoETuning:
    """Which experts path runs a batch. CPU: all experts densely while that costs at most
    ``dense_macs`` MACs; at most ``fused_tokens`` tokens through the compiled experts loop when
    the experts' weights (read in place, as numpy views) fit in ``fused_bytes``. CUDA half
    precision: ``grouped``, when prefill sizes take ``kernels.moe_grouped`` and its launches;
    ``fp4_prefill``, the path of checkpoint-FP4 experts at prefill sizes."""

    dense_macs: int = 1 << 23
    fused_tokens: int = 64
    fused_bytes: int = 64 << 20
    grouped: GroupedMoETuning = field(default_factory=GroupedMoETuning)
    fp4_prefill: Fp4PrefillTuning = field(default_factory=Fp4PrefillTuning)


MOE = MoETuning()  # the default


def _half_cuda(x: torch.Tensor) -> bool:
    """CUDA bf16/fp16 with Triton: routing, the shared expert's SwiGLU and the combine as kernels."""
    from kernels._common import HAS_TRITON

    return HAS_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


class Router(nn.Module):
    """The gate of one MoE layer (``hash=True``: experts looked up from ``tid2eid``)."""

    def __init__(self, cfg: ModelConfig, hash_routed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.scoring_func = cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (N, H)`` → expert weights ``(N, k)`` and indices ``(N, k)``. CUDA bf16/fp16: after the
        gate GEMM one Triton kernel (``kernels.moe.route``, fp32 weights) instead of ~9 launches."""
        if _half_cuda(x):
            from kernels.moe import route

            hashed = self.hash_routed
            return route(
                F.linear(x, self.weight), self.top_k, self.scaling, None if hashed else self.e_score_correction_bias,
                self.tid2eid if hashed else None, token_ids if hashed else None, self.scoring_func,
            )  # fmt: skip
        scores = score(F.linear(x, self.weight), self.scoring_func)  # (N, E)
        if self.hash_routed:
            indices = self.tid2eid[token_ids].long()
        else:
            indices = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class Experts(nn.Module):
    """Routed experts stored as stacked tensors (transformers' layout).

    ``gate_up_proj (E, 2I, H)``: rows ``[:I]`` gate, ``[I:]`` up. ``down_proj (E, H, I)``.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tuning: MoETuning = MOE, fp4: bool = False) -> None:
        super().__init__()
        self.tuning = tuning
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.shape = (e, 2 * i, h)  # gate_up's (E, 2I, H), whatever the storage
        # ``fp4``: the loader will keep the checkpoint's FP4 experts (``self.fp4``), so the dense
        # parameters stay empty from the start (at V4-Flash width they would be 12.9 GB a layer)
        self.gate_up_proj = nn.Parameter(torch.empty(0 if fp4 else (e, 2 * i, h), dtype=dtype), requires_grad=not fp4)
        self.down_proj = nn.Parameter(torch.empty(0 if fp4 else (e, h, i), dtype=dtype), requires_grad=not fp4)
        self.limit = cfg.swiglu_limit
        # the checkpoint's FP4 experts kept as stored (load_model(fp4_experts=True)): packed
        # gate_up (E, 2I, H/2), its e8m0 scales (E, 2I, H/32), down (E, H, I/2), scales (E, H, I/64);
        # the bf16 parameters are then empty and every call runs kernels.moe_fp4
        self.fp4: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over each token's chosen experts, grouping tokens by expert (ascending expert id).

        The ``N·k`` (token, expert) slots are sorted by expert once; each expert runs on its
        contiguous run of gathered tokens, writing into one output buffer; one weighted
        ``index_add_`` then adds every slot to its token, in slot order (= ascending expert, as
        one ``index_add_`` per expert would). ``add`` (CUDA bf16/fp16 only): added in the combine.
        """
        if self.fp4 is not None:
            from kernels.moe_fp4 import moe_experts_fp4

            return moe_experts_fp4(x, weights, indices, *self.fp4, self.limit, add, self.tuning.fp4_prefill)
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from kernels.moe import (
                moe_experts,  # grouped GEMM + fused SwiGLU/combine (Triton)
            )

            return moe_experts(x, weights, indices, self.gate_up_proj, self.down_proj, self.limit, add, self.tuning.grouped)
        assert add is None, "add is for the CUDA half-precision path"
        if x.device.type == "cpu" and x.shape[0] * self.gate_up_proj.numel() * 3 // 2 <= self.tuning.dense_macs:
            return self._dense(x, weights, indices)
        flat_experts = indices.reshape(-1)  # (N*k,)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // indices.shape[1]  # (N*k,) token index per sorted slot
        xs = x.index_select(0, token_of)  # (N*k, H) tokens in expert order
        ys = torch.empty_like(xs)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            gate, up = F.linear(xs[start : start + count], self.gate_up_proj[expert]).chunk(2, dim=-1)
            ys[start : start + count] = F.linear(swiglu(gate, up, self.limit), self.down_proj[expert])  # (count, H)
            start += count
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)  # weights promote, as per expert
        return torch.zeros_like(x).index_add_(0, token_of, ys)


    def _dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Few tokens, small experts (CPU decode): every expert on every token in two GEMMs
        (a handful of ops instead of ~10 per expert), then each token's chosen outputs, weighted
        and added in ascending expert order as ``forward``'s ``index_add_`` adds them."""
        n = x.shape[0]
        e, two_i, h = self.gate_up_proj.shape
        gate, up = F.linear(x, self.gate_up_proj.view(e * two_i, h)).view(n, e, two_i).chunk(2, dim=-1)
        act = swiglu(gate, up, self.limit).transpose(0, 1)  # (E, N, I)
        out_all = torch.bmm(act, self.down_proj.transpose(1, 2))  # (E, N, H)
        experts, order = indices.sort(dim=1, stable=True)  # (N, k) ascending expert
        slot_w = weights.gather(1, order).unsqueeze(-1)  # (N, k, 1)
        picked = out_all[experts, torch.arange(n, device=x.device).unsqueeze(1)]  # (N, k, H)
        ys = (picked * slot_w).to(x.dtype)
        out = torch.zeros_like(x)
        for j in range(indices.shape[1]):
            out += ys[:, j]
        return out


class MoE(nn.Module):
    """One MoE block: routed experts + the shared expert on the same input."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, tuning: MoETuning = MOE, fp4_experts: bool = False) -> None:
        super().__init__()
        self.gate = Router(cfg, cfg.mlp_layer_types[layer_idx] == "hash_moe", dtype)
        self.experts = Experts(cfg, dtype, tuning, fp4_experts)
        self.shared_experts = SharedMLP(cfg, dtype)
        self.fused = True  # CPU decode: routed + shared experts in one compiled loop (cpu_fused)
        # expert parallelism: ``(moe, x, token_ids) -> out`` running the routed experts over the
        # group (engine.parallel.group.ExpertGroup.attach); None on one device
        self.ep: Callable[[MoE, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._packed: tuple | None = None
        self._packed_key: tuple[tuple[int, int], ...] | None = None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self.ep(self, x, token_ids)
        weights, indices = self.gate(x, token_ids)
        if _half_cuda(x):  # the shared expert's output joins the routed sum inside the combine kernel
            return self.experts(x, weights, indices, add=self.shared_experts(x))
        packed = self._fused_weights(x)
        if packed is not None:
            return cpu_fused.experts(x, weights, indices, packed, self.experts.limit)
        return self.experts(x, weights, indices) + self.shared_experts(x)

    def _fused_weights(self, x: torch.Tensor) -> tuple | None:
        """The transposed weights of ``cpu_fused.experts`` when it should run ``x``: a few fp32
        CPU tokens, small experts; rebuilt whenever a weight changes (loaders ``copy_`` in)."""
        tuning = self.experts.tuning
        if not (self.fused and x.shape[0] <= tuning.fused_tokens and cpu_fused.usable(x)) or self.experts.fp4 is not None:
            return None
        ex, sh = self.experts, self.shared_experts
        params = (ex.gate_up_proj, ex.down_proj, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
        if any(p.dtype != torch.float32 for p in params) or sum(p.numel() for p in params) * 4 > tuning.fused_bytes:
            return None
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key != self._packed_key:
            self._packed, self._packed_key = cpu_fused.pack_experts(*params), key
        return self._packed
