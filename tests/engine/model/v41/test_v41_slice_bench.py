"""``bench.v41_slice_bench`` on a tiny slice on the CPU: every row, the prefill breakdown adds
up, and the fast path's prefill gives the general path's logits."""

from __future__ import annotations

import torch

from bench.v41_slice_bench import SLICE, prefill_flops, run, summary
from engine.model.v41.attention import V41Tuning
from engine.model.v41.config import V41Config

TINY = V41Config(
    vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=64, q_lora_rank=32, qk_rope_head_dim=16,
    sliding_window=8, index_n_heads=2, index_head_dim=32, index_topk=4, candidate_topk_blocks=2, candidate_block_size=2,
    o_groups=2, o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=8, hc_sinkhorn_iters=3, **SLICE,
)  # fmt: skip


def test_prefill_flops_add_up() -> None:
    f = prefill_flops(TINY, 1e6, 64)
    assert f["total"] == f["experts"] + f["attention"] + f["rest"] and min(f.values()) > 0


def test_bench_rows_on_a_tiny_slice() -> None:
    torch.manual_seed(0)
    out = run(TINY, "cpu", [1, 2], 24, 48, 1, 1e12, 1e12, general=True, tuning=V41Tuning(fast=True))
    decode = [r for r in out["rows"] if r["kind"] == "decode"]
    (pre,) = [r for r in out["rows"] if r["kind"] == "prefill"]
    assert [r["batch"] for r in decode] == [1, 2] and all(r["step_ms"] > 0 for r in decode)
    b = pre["breakdown"]
    parts = b["attention"]["seconds"] + b["experts"]["seconds"] + b["rest"]["seconds"]
    inside = b["inside_attention_seconds"]
    assert abs(parts - b["synced_seconds"]) < 1e-9 and 0 < sum(inside.values()) <= b["attention"]["seconds"]
    assert min(inside.values()) > 0 and b["experts"]["seconds"] > 0
    assert pre["of_matmul_rate"] > 0 and pre["general"]["same_argmax"]
    # bf16: other roundings (the fp32 parity is test_v41_fast's); a wrong path would be far off
    assert pre["general"]["max_err_over_max_logit"] < 0.5
    assert "% of the bf16 matmul rate" in summary(out)


def test_the_slice_experts_are_stacked_once() -> None:
    """``MoE.stack`` keeps the bench's stacks (a restack would copy 27 GB a layer at Flash width)
    and stacks an unstacked model once, its expert parameters becoming views."""
    from bench.v41_slice_bench import random_slice
    from engine.model.v41.model import DeepseekV41ForCausalLM

    model, stacks = random_slice(TINY, "cpu", torch.float32)
    for layer, (gate_up, down) in zip(model.model.layers, stacks):
        got = layer.ffn.stack()
        assert got[0] is gate_up and got[1] is down
    fresh = DeepseekV41ForCausalLM(TINY).model.layers[0].ffn
    w1 = fresh.experts[3].w1.weight.detach().clone()
    gate_up, down = fresh.stack()
    assert fresh.stack()[0] is gate_up and torch.equal(gate_up[3, : TINY.moe_intermediate_size], w1)
    assert fresh.experts[3].w1.weight.data_ptr() == gate_up[3].data_ptr()
