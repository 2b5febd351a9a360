"""Small building blocks of DeepSeek-V4: norms, grouped output projection, SwiGLU MLP, mHC.

Parameter names match ``transformers``' DeepseekV4 modules, so its checkpoints load by name.
All token-wise modules take flattened tokens ``(N, ...)``; there is no batch/sequence axis here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import cpu_fused
from engine.model.config import ModelConfig
from kernels.reference import collapse, mix_gates, unweighted_rms_norm_eager


class RMSNorm(nn.Module):
    """RMSNorm whose weight stays in fp32; normalises and multiplies in fp32, casts once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_norm(x):
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight (query heads, mHC inputs); the scale is computed in fp32."""
    if _fused_norm(x):
        return cpu_fused.rms_norm(x, None, eps)
    return unweighted_rms_norm_eager(x, eps)


def _fused_norm(x: torch.Tensor) -> bool:
    """A few contiguous fp32 CPU rows: ``cpu_fused.rms_norm`` (one call instead of ~6 ops)."""
    return x.numel() <= cpu_fused.NORM_ROWS * x.shape[-1] and x.is_contiguous() and cpu_fused.usable(x)


def normed_linear(x: torch.Tensor, weight: torch.Tensor, eps: float, fold: bool = True) -> torch.Tensor:
    """``F.linear(unweighted_rms_norm(x), weight)``. With ``fold`` on CPU, for more rows than
    ``cpu_fused.NORM_ROWS``, the per-row RMS scale is applied to the (narrow) product instead of
    the (wide) input — the same value up to rounding, one pass over ``x`` fewer (the mHC input
    is ``hc·H`` wide, its product ``(2+hc)·hc``)."""
    if fold and x.device.type == "cpu" and x.shape[0] > cpu_fused.NORM_ROWS:
        sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])  # mean(x²), no (N, hc·H) temporary
        scale = torch.rsqrt(sq + eps).to(x.dtype)  # (N, 1)
        return F.linear(x, weight).mul_(scale)
    return F.linear(unweighted_rms_norm(x, eps), weight)


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

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` written straight into ``(N, G, out/G)`` rows (a transposed ``bmm`` output):
        contiguous, so a later ``flatten(1)`` copies nothing (the fast paths' form on CUDA; on the
        CPU a GEMM into a strided output can round differently from ``forward``)."""
        w = self.weight.view(self.n_groups, -1, x.shape[-1]).transpose(1, 2)  # (G, in, out/G)
        out = x.new_empty(x.shape[0], self.n_groups, w.shape[-1])
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out


def replicate_streams(x: torch.Tensor, hc: int) -> torch.Tensor:
    """The mHC streams' start: ``hc`` copies of each row of ``x (N, H)`` as ``(N, hc, H)``, by one
    concatenation (on CUDA a vectorised copy: the broadcast ``expand(...).contiguous()`` ran at
    ~0.9 TB/s on an H200, 0.34 ms at V4's 8K × 4 × 4096 bf16; the same values)."""
    return torch.cat([x] * hc, dim=1).view(x.shape[0], hc, x.shape[1])


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
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from kernels import fused

            if fused.use_triton(x):  # one Triton pass instead of four elementwise kernels
                return self.down_proj(fused.swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
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
        self.fused = True  # CPU: the mixing as one compiled loop (cpu_fused.hc_mix) when available

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        mixes = normed_linear(streams.flatten(1).float(), self.fn.float(), self.norm_eps, self.fused)  # (N, (2+hc)*hc)
        if self.fused and cpu_fused.usable(streams) and not mixes.requires_grad:
            return cpu_fused.hc_pre(mixes, self.scale, self.base, streams, self.iters, self.hc_eps)
        pre, post, comb = mix_gates(mixes, self.scale, self.base, hc, self.iters, self.hc_eps)
        return post, comb, collapse(pre, streams)


def hc_merge(
    post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor, fused: bool = True
) -> torch.Tensor:
    """New streams ``(N, hc, H)`` = post ⊗ block output + combᵀ @ old streams (one ``baddbmm``;
    ``fused``: one compiled loop on fp32 CPU tensors, ``cpu_fused.hc_merge``)."""
    if fused and cpu_fused.usable(streams) and block_out.dtype == torch.float32:
        return cpu_fused.hc_merge(post, comb, block_out, streams)
    if streams.is_cuda and streams.is_contiguous() and block_out.is_contiguous():
        from kernels import (
            fused,  # one Triton kernel (prefill: the baddbmm ran a slow sm80 kernel)
        )

        if fused.use_triton(streams):
            return fused.hc_merge(post, comb, block_out, streams)
    dtype = streams.dtype
    mix = comb.to(dtype).transpose(-1, -2).contiguous()  # (N, hc, hc); a strided view is 10x slower in bmm
    return torch.baddbmm(post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2), mix, streams)


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
        return collapse(pre, streams)


class PackedLinear:
    """``linear(x)`` through oneDNN with a pre-packed copy of the weight (CPU, fp32, ≥ 2 rows).

    For the vocabulary projection (V=129k, H=128, one thread) oneDNN's blocked weight layout runs
    8-64 rows ~30% faster than BLAS, with the same values from 5 rows on (measured); one row stays
    on ``linear``, which is faster there. The packed copy doubles the weight's memory and is
    rebuilt whenever the weight changes (loaders ``copy_`` into it, bumping its version).
    """

    PACK_ROWS = 32  # the row count oneDNN is told to expect when packing

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def usable(self, x: torch.Tensor) -> bool:
        w = self.linear.weight
        return (
            x.shape[0] >= 2 and x.dim() == 2 and w.device.type == "cpu" and w.dtype == x.dtype == torch.float32
            and self.linear.bias is None and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.usable(x):
            return self.linear(x)
        w = self.linear.weight
        key = (w.data_ptr(), w._version)
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.PACK_ROWS)
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")

