"""FP8 (e4m3, 128×128 block scales) copies of the routed experts' weights for the GPU decode step.

``attach_fp8_experts(model)`` quantises each MoE layer's ``gate_up_proj`` / ``down_proj`` block by
block (amax / 448 per 128×128 block, DeepSeek's checkpoint format) and stores them on the
``Experts`` module as ``fp8 = (gate_up_q, gate_up_s, down_q, down_s)``; ``StaticDecoder`` then
runs the routed experts through ``kernels.moe_fp8.moe_experts_fp8`` (the general path keeps
the bf16 weights). ``drop_bf16=True`` frees the bf16 expert weights (then only the static step
can run the experts). A checkpoint that already stores FP8 experts could hand its tensors over
unchanged; the loader dequantises them today (not done: a loader option that keeps them).
"""

from __future__ import annotations

import torch

from kernels.moe_fp8 import quantize_blocks


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
