"""DeepSeek-V4.1 mixture of experts: V4's routed + shared experts behind V4.1's router.

The experts (clamped SwiGLU, stacked ``gate_up_proj`` / ``down_proj``) and the shared expert are
V4's modules unchanged. The router differs from V4's in two details: the gate logits are
divided by ``gate_temp`` before the score function, and the chosen weights are normalised only
with ``norm_topk_prob`` and more than one expert per token. There is no hash routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.moe import MoE, Router, score
from engine.model.v41.config import V41Config


class V41Router(Router):
    """Score routing: experts by ``top-k(score(logits / gate_temp) + bias)``, weights from the
    unbiased scores (``e_score_correction_bias`` is the checkpoint's ``gate.bias``)."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__(cfg, False, dtype)  # type: ignore[arg-type]  # reads the fields V4's config shares
        self.gate_temp = cfg.gate_temp
        self.normalize = cfg.norm_topk_prob and cfg.num_experts_per_tok > 1

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (N, H)`` → expert weights ``(N, k)`` and indices ``(N, k)``; routing in fp32."""
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        scores = score(logits, self.scoring_func)
        indices = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class V41MoE(MoE):
    """V4's ``MoE`` block with the V4.1 router."""

    def __init__(self, cfg: V41Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_idx, dtype)  # type: ignore[arg-type]
        self.gate = V41Router(cfg, dtype)
