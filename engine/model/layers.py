"""Small building blocks of DeepSeek-V4: norms, grouped output projection, SwiGLU MLP, mHC.

Parameter names match ``transformers``' DeepseekV4 modules, so its checkpoints load by name.
All token-wise modules take flattened tokens ``(N, ...)``; there is no batch/sequence axis here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm whose weight stays in fp32; normalises and multiplies in fp32, casts once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight (query heads, mHC inputs); the scale is computed in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of ``n_groups`` head groups maps to its own slice."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group, dtype=dtype))
        self.n_groups = n_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (N, G, in_per_group) -> (N, G, out/G)
        w = self.weight.view(self.n_groups, -1, x.shape[-1]).transpose(1, 2)  # (G, in, out/G)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: gate clamped above, up clamped both ways (V4's ``swiglu_limit``)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedMLP(nn.Module):
    """The shared expert: a dense SwiGLU MLP of width ``moe_intermediate_size``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection (mHC) around one attention or MLP block.

    From the ``hc`` residual streams ``(N, hc, H)`` it computes ``pre (N, hc)`` (collapse the
    streams into the block input), ``post (N, hc)`` (expand the block output) and a
    doubly-stochastic ``comb (N, hc, hc)`` (Sinkhorn) mixing the residual streams. All in fp32.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc = hc
        self.iters = cfg.hc_sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)  # (N, hc*H)
        mixes = F.linear(flat, self.fn.float())  # (N, (2+hc)*hc)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps  # (N, hc)
        post = 2 * torch.sigmoid(post_w * post_s + post_b)  # (N, hc)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # (N, H)
        return post, comb, collapsed


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """New streams ``(N, hc, H)`` = post ⊗ block output + combᵀ @ old streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the ``hc`` streams into one hidden state before the last norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)  # (N, hc*H)
        mixes = F.linear(flat, self.hc_fn.float())  # (N, hc)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # (N, H)
