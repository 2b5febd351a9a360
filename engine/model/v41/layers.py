"""Token-wise building blocks of DeepSeek-V4.1 written in the reference's operation order.

V4.1's caches are rounded onto FP8/FP4 grids (``quant.py``), so a last-bit difference upstream
can move a value across a rounding boundary (or break an exact top-k tie differently) and
change the output by far more than the bit. The reference path therefore computes norms, the
mHC collapse/expand and the MoE with the same operations, shapes and order as the
``transformers`` reference, instead of V4's fused CPU kernels (same math, other roundings).
The mHC gates and the router scores are the shared ``kernels.reference`` math V4 uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.v41.config import V41Config
from kernels.reference import mix_gates, score


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ`` in fp32, the reference's ``F.linear(x.float(), weight.float())``: on CUDA with
    bf16 operands one tensor-core GEMM with an fp32 output (a product of two bf16 values is exact
    in fp32, so only the order of the fp32 sums differs), else both operands widened."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float(), weight.float())


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight: normalise in fp32, cast, then scale in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight.to(x.dtype) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HyperSite(nn.Module):
    """The mHC parameters of one site, as raw tensors (``hc_{site}_fn / _base / _scale``)."""

    def __init__(self, cfg: V41Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def gates(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams (N, hc, H)`` → ``pre (N, hc)``, ``post (N, hc)``, doubly-stochastic ``comb (N, hc, hc)``."""
        flat = streams.flatten(1).float()  # (N, hc·H), normalised as one vector per token
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        return mix_gates(F.linear(flat, self.fn.float()), self.scale, self.base, self.hc, self.iters, self.hc_eps)


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``Σ_s pre[:, s] · streams[:, s]`` in fp32: ``pre (N, hc)``, ``streams (N, hc, H)`` → ``(N, H)``."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def expand(x: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``out_k = post_k · x + Σ_j comb[j, k] · streams_j``: ``x (N, H)`` → ``(N, hc, H)``."""
    mixed = torch.einsum("bsjk,bsjd->bskd", comb.float()[None], streams.float()[None])[0]  # (N, hc, H)
    return (post.unsqueeze(-1) * x.float().unsqueeze(-2) + mixed).to(streams.dtype)


class Expert(nn.Module):
    """One clamped-SwiGLU expert (``w1`` gate, ``w3`` up, ``w2`` down); the routing weight scales
    the activation before ``w2``."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nn.Linear(h, i, bias=False, dtype=dtype)
        self.w2 = nn.Linear(i, h, bias=False, dtype=dtype)
        self.w3 = nn.Linear(h, i, bias=False, dtype=dtype)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up, gate = up.clamp(-self.limit, self.limit), gate.clamp(max=self.limit)
        y = F.silu(gate) * up
        return self.w2((y if weight is None else weight * y).to(x.dtype))


class Router(nn.Module):
    """Experts by ``top-k(score(logits / gate_temp) + bias)``; weights from the unbiased scores,
    normalised (``norm_topk_prob``, k > 1) and scaled by ``routed_scaling_factor``. Routing in fp32."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.scoring_func, self.temp = cfg.num_experts_per_tok, cfg.scoring_func, cfg.gate_temp
        self.normalize = cfg.norm_topk_prob and cfg.num_experts_per_tok > 1
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (N, H)`` → weights ``(N, k)`` and expert indices ``(N, k)``."""
        return self.route(linear_fp32(x, self.weight))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` from the fp32 router logits ``(N, E)`` (``x · weightᵀ``)."""
        scores = score(logits / self.temp, self.scoring_func)  # (N, E)
        indices = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class MoE(nn.Module):
    """Routed experts (each on the tokens that chose it, in expert order) plus the shared expert."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(cfg, dtype)
        self.experts = nn.ModuleList([Expert(cfg, dtype) for _ in range(cfg.n_routed_experts)])
        self.shared_experts = Expert(cfg, dtype)
        self.stacks: tuple[torch.Tensor, torch.Tensor] | None = None  # see stack()
        self.shared_stack: torch.Tensor | None = None  # see shared_gate_up()

    @torch.no_grad()
    def stack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts as stacks, gate|up ``(E, 2I, H)`` and down ``(E, H, I)``, the
        experts' parameters made views of them (the weights held once). Built on the first call;
        kept while the parameters still are those views (a builder may set ``stacks`` itself)."""
        first, last = self.experts[0], self.experts[-1]
        if self.stacks is not None:
            gate_up, down = self.stacks
            if first.w1.weight.data_ptr() == gate_up.data_ptr() and last.w2.weight.data_ptr() == down[-1].data_ptr():
                return self.stacks
        gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts])  # (E, 2I, H)
        down = torch.stack([e.w2.weight for e in self.experts])  # (E, H, I)
        inter = gate_up.shape[1] // 2
        for j, e in enumerate(self.experts):
            e.w1.weight.data, e.w3.weight.data, e.w2.weight.data = gate_up[j, :inter], gate_up[j, inter:], down[j]
        self.stacks = (gate_up, down)
        return self.stacks

    @torch.no_grad()
    def shared_gate_up(self) -> torch.Tensor:
        """The shared expert's gate|up ``(2I, H)`` as one matrix, its ``w1``/``w3`` made views of
        it (the weights held once). Built on the first call; kept while they still are those views."""
        se = self.shared_experts
        inter = se.w1.weight.shape[0]
        both = self.shared_stack
        if both is not None and se.w1.weight.data_ptr() == both.data_ptr() and se.w3.weight.data_ptr() == both[inter].data_ptr():
            return both
        both = torch.cat([se.w1.weight, se.w3.weight])  # (2I, H)
        se.w1.weight.data, se.w3.weight.data = both[:inter], both[inter:]
        self.shared_stack = both
        return both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)  # (N, k) each
        y = torch.zeros_like(x, dtype=torch.float32)  # (N, H)
        for e in torch.unique(indices).tolist():
            tok, slot = torch.where(indices == e)
            y[tok] += self.experts[e](x[tok], weights[tok, slot, None]).float()
        y += self.shared_experts(x).float()
        return y.to(x.dtype)
