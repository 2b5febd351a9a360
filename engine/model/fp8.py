"""FP8 (e4m3, 128×128 block scales) weights on the device: checkpoint linears kept as FP8, and FP8
copies of the routed experts' weights for the GPU decode step.

``Fp8Linear`` is a linear layer whose weight stays as the checkpoint stores it (e4m3 plus one
ue8m0 scale per 128×128 block) and runs through ``kernels.fp8_gemm`` (activations quantised per
1×128 group; the PyTorch reference of the same function off CUDA). ``load_model(..., fp8=config)``
puts one in place of every ``nn.Linear`` whose checkpoint weight is FP8 with block scales;
without it the loader dequantises them (the bf16 parity path).

``attach_fp8_experts(model)`` quantises each MoE layer's ``gate_up_proj`` / ``down_proj`` block by
block (amax / 448 per 128×128 block, DeepSeek's checkpoint format) and stores them on the
``Experts`` module as ``fp8 = (gate_up_q, gate_up_s, down_q, down_s)``; ``StaticDecoder`` then
runs the routed experts through ``kernels.moe_fp8.moe_experts_fp8`` (the general path keeps
the bf16 weights). ``drop_bf16=True`` frees the bf16 expert weights (then only the static step
can run the experts). A checkpoint that already stores FP8 experts could hand its tensors over
unchanged; the loader dequantises them today (not done: a loader option that keeps them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kernels.fp8_gemm import BLOCK, DEFAULT, Fp8GemmConfig, fp8_linear, scales_to_fp32
from kernels.moe_fp8 import quantize_blocks


class Fp8Linear(nn.Module):
    """``y = x · dequant(weight)ᵀ`` with ``weight (N, K)`` e4m3 and ``weight_scale (⌈N/128⌉, ⌈K/128⌉)``
    fp32 (buffers, so ``named_parameters`` stays the bf16 model's), bias-free as V4's linears."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, config: Fp8GemmConfig = DEFAULT) -> None:
        super().__init__()
        assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, "Fp8Linear: an e4m3 (N, K) weight"
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", scales_to_fp32(scale).to(weight.device))
        self.out_features, self.in_features = weight.shape
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.config)  # (T, N)
        return y.view(*x.shape[:-1], self.out_features)


class Fp8Weight(NamedTuple):
    """A linear's FP8 weight as the fused decode step reads it: e4m3 ``q (N, K)``, fp32 block scales ``s``."""

    q: torch.Tensor
    s: torch.Tensor


Weight = torch.Tensor | Fp8Weight  # a dense weight (N, K) in the model's dtype, or an FP8 one


def weight_of(linear: nn.Module) -> Weight:
    """``linear``'s weight: ``Fp8Weight`` for an ``Fp8Linear``, else its dense ``weight`` tensor."""
    if isinstance(linear, Fp8Linear):
        return Fp8Weight(linear.weight, linear.weight_scale)
    return linear.weight


def merge_weights(weights: list[Weight]) -> list[tuple[Weight, tuple[int, ...]]]:
    """Runs of same-kind weights of one input concatenated along N (one GEMM each), with each
    run's output widths: dense runs always, FP8 runs while every part but the last has whole
    128-row scale blocks (so the scale grids stack)."""
    runs: list[tuple[Weight, tuple[int, ...]]] = []
    group: list[Weight] = []

    def close() -> None:
        if group:
            if isinstance(group[0], Fp8Weight):
                merged: Weight = Fp8Weight(torch.cat([w.q for w in group]).contiguous(), torch.cat([w.s for w in group]).contiguous())
            else:
                merged = torch.cat(group).contiguous()
            runs.append((merged, tuple(w[0].shape[0] if isinstance(w, Fp8Weight) else w.shape[0] for w in group)))
            group.clear()

    for w in weights:
        fp8 = isinstance(w, Fp8Weight)
        if group and (fp8 != isinstance(group[0], Fp8Weight) or fp8 and group[-1].q.shape[0] % BLOCK):
            close()
        group.append(w)
    close()
    return runs


def keeps_native_weights(model: nn.Module) -> bool:
    """Whether ``model`` holds checkpoint-format weights: an ``Fp8Linear`` or packed FP4 experts."""
    return any(isinstance(m, Fp8Linear) or getattr(m, "fp4", None) is not None for m in model.modules())


def replace_linear(model: nn.Module, name: str, weight: torch.Tensor, scale: torch.Tensor, config: Fp8GemmConfig) -> bool:
    """Put an ``Fp8Linear`` of ``weight``/``scale`` (moved to the model's device) in place of the
    ``nn.Linear`` whose weight is ``name``; False (nothing changed) when ``name`` is no such weight."""
    path, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return False
    if leaf != "weight" or not isinstance(mod, nn.Linear) or tuple(mod.weight.shape) != tuple(weight.shape):
        return False
    parent, _, child = path.rpartition(".")
    device = mod.weight.device
    setattr(model.get_submodule(parent), child, Fp8Linear(weight.to(device), scale.to(device), config))
    return True


def _quantize_per_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qs, ss = zip(*(quantize_blocks(w[e]) for e in range(w.shape[0])))  # one expert at a time: small fp32 temporaries
    return torch.stack(qs), torch.stack(ss)


@torch.no_grad()
def attach_fp8_experts(model, drop_bf16: bool = False) -> int:
    """Quantise every layer's routed experts (see the module docstring). → bytes of FP8 weights."""
    total = 0
    for layer in model.model.layers:
        ex = layer.mlp.experts
        gq, gs = _quantize_per_expert(ex.gate_up_proj.data)
        dq, ds = _quantize_per_expert(ex.down_proj.data)
        ex.fp8 = (gq, gs, dq, ds)
        total += gq.numel() + dq.numel() + 4 * (gs.numel() + ds.numel())
        if drop_bf16:
            ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.data.new_empty(0), requires_grad=False)
            ex.down_proj = torch.nn.Parameter(ex.down_proj.data.new_empty(0), requires_grad=False)
    return total
