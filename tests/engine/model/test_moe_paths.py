"""The CPU MoE's dense small-batch path equals the per-expert loop (engine/model/moe.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model import moe


@pytest.mark.parametrize("n,k", [(1, 2), (5, 2), (12, 6)])
def test_dense_equals_expert_loop(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SimpleNamespace(n_routed_experts=8, hidden_size=32, moe_intermediate_size=16, swiglu_limit=7.0)
    experts = moe.Experts(cfg, torch.float32)
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2, generator=g)
        experts.down_proj.normal_(0, 0.2, generator=g)
    x = torch.randn(n, 32, generator=g) * 2
    indices = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    with torch.inference_mode():
        dense = experts(x, weights, indices)
        monkeypatch.setattr(moe, "DENSE_MACS", 0)  # force the loop
        loop = experts(x, weights, indices)
    torch.testing.assert_close(dense, loop, rtol=1e-5, atol=1e-6)
