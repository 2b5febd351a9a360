"""The CPU MoE's dense small-batch path equals the per-expert loop (engine/model/moe.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model import moe


@pytest.mark.parametrize("n,k", [(1, 2), (5, 2), (12, 6)])
def test_dense_equals_expert_loop(n: int, k: int) -> None:
    cfg = SimpleNamespace(n_routed_experts=8, hidden_size=32, moe_intermediate_size=16, swiglu_limit=7.0)
    experts = moe.Experts(cfg, torch.float32)
    looped = moe.Experts(cfg, torch.float32, moe.MoETuning(dense_macs=0))  # never dense: the loop
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2, generator=g)
        experts.down_proj.normal_(0, 0.2, generator=g)
    x = torch.randn(n, 32, generator=g) * 2
    indices = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    with torch.inference_mode():
        looped.load_state_dict(experts.state_dict())
        dense = experts(x, weights, indices)
        loop = looped(x, weights, indices)
    torch.testing.assert_close(dense, loop, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not moe.cpu_fused.available(), reason="numba is not usable here")
@pytest.mark.parametrize("n,k,hash_routed", [(1, 2, False), (7, 2, True), (20, 6, False)])
def test_fused_block_equals_eager_and_is_per_token(n: int, k: int, hash_routed: bool) -> None:
    cfg = SimpleNamespace(
        n_routed_experts=8, hidden_size=32, moe_intermediate_size=16, swiglu_limit=7.0, num_experts_per_tok=k,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, vocab_size=50,
        mlp_layer_types=["hash_moe" if hash_routed else "moe"],
    )  # fmt: skip
    block = moe.MoE(cfg, 0, torch.float32)
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3, generator=g)
        if hash_routed:
            block.gate.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(50)]))
    x, ids = torch.randn(n, 32, generator=g) * 2, torch.randint(0, 50, (n,), generator=g)
    with torch.inference_mode():
        fused = block(x, ids)
        assert block._packed is not None  # the compiled loop ran
        block.fused = False
        eager = block(x, ids)
        block.fused = True
        weights, indices = block.gate(x, ids)  # the compiled loop computes each token alone
        m = slice(n // 2, n // 2 + 1)
        alone = moe.cpu_fused.experts(x[m], weights[m], indices[m], block._packed, cfg.swiglu_limit)
        with torch.no_grad():  # a weight change repacks
            block.experts.down_proj.mul_(2)
        changed = block(x, ids)
        block.fused = False
        changed_eager = block(x, ids)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone, fused[m])
    torch.testing.assert_close(changed, changed_eager, rtol=1e-5, atol=1e-5)
