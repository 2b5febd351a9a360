"""The static decode step on CUDA with CUDA graphs: fp32 within 1e-4 of the general path (logits
and states), bf16 as close to the fp32 truth as the general path's bf16.

Run on a GPU machine: ``pytest -m gpu tests/engine/model/test_static_decode_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.model.loader import load_model
from engine.model.static_decode import StaticDecoder
from tests.engine.model.test_static_decode import (
    LENGTHS,
    assert_states_close,
    prefilled,
    run_both,
)


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "small_windows_model_dir"])
def test_cuda_graph_fp32_matches_general_path(request, fixture) -> None:
    model = load_model(
        request.getfixturevalue(fixture), dtype="float32", device="cuda", progress=False
    )
    worst, general, exported, dec = run_both(
        model, LENGTHS, steps=40, seed=1, max_slots=20, use_graphs=True
    )
    assert sorted(dec._graphs) == [8, 20]  # two buckets captured and replayed
    assert worst <= 1e-4, worst
    for a, b in zip(general, exported):
        assert_states_close(a, b, 1e-4)


def test_cuda_graph_bf16_as_close_as_general_path(tiny_model_dir) -> None:
    """Teacher-forced decode of 12 sequences for 60 steps: the graph path's bf16 logits are as
    close to the fp32 general path as the general path's own bf16 logits."""
    ref = load_model(tiny_model_dir, dtype="float32", device="cuda", progress=False)
    m16 = load_model(tiny_model_dir, dtype="bfloat16", device="cuda", progress=False)
    lengths = [1, 4, 7, 64, 126, 127, 128, 129, 200, 255, 256, 300]
    truth_st = prefilled(ref, lengths, seed=7)
    gen_st = prefilled(m16, lengths, seed=7)
    dec = StaticDecoder(m16, max_slots=16, max_tokens=400, use_graphs=True)
    for i, st in enumerate(prefilled(m16, lengths, seed=7)):
        dec.load(i, st)
    rng = random.Random(8)
    err_gen = err_static = 0.0
    agree = total = 0
    for _ in range(60):
        toks = [rng.randrange(2, 129280) for _ in lengths]
        truth = ref([(st, [t]) for st, t in zip(truth_st, toks)])
        gen = m16([(st, [t]) for st, t in zip(gen_st, toks)])
        got = dec.step(list(range(len(lengths))), toks).float()
        err_gen += (gen - truth).abs().mean().item()
        err_static += (got - truth).abs().mean().item()
        agree += int((got.argmax(-1) == gen.argmax(-1)).sum())
        total += len(lengths)
    assert err_static <= 1.5 * err_gen + 1e-3, (err_static, err_gen)
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.parametrize("lengths", [[3, 130, 256], [130], [3, 256]])
def test_graph_replay_equals_eager_step(tiny_model_dir, lengths) -> None:
    """The captured graph computes what the same step computes eagerly (bf16; batch 1-2: the
    GEMV kernels)."""
    m16 = load_model(tiny_model_dir, dtype="bfloat16", device="cuda", progress=False)
    decs = []
    for graphs in (False, True):
        dec = StaticDecoder(m16, max_slots=4, max_tokens=300, use_graphs=graphs)
        for i, st in enumerate(prefilled(m16, lengths, seed=9)):
            dec.load(i, st)
        decs.append(dec)
    rng = random.Random(10)
    for _ in range(10):
        toks = [rng.randrange(2, 129280) for _ in lengths]
        a = decs[0].step(list(range(len(lengths))), toks).float()
        b = decs[1].step(list(range(len(lengths))), toks).float()
        assert (a - b).abs().max().item() <= 1e-2 * a.abs().max().item()


def _flash_width_model(layer_types: list[str], n_experts: int, vocab: int):
    """Our model at V4-Flash width (hidden 4096, 64×512 heads, indexer 64×128, top-k 512) with
    few experts and layers, fp32 on CUDA, random weights as ``tiny.random_state_dict`` draws them."""
    import math

    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM
    from engine.model.tiny import tiny_config_dict

    raw = tiny_config_dict("tiny")
    raw.update(
        hidden_size=4096, head_dim=512, num_attention_heads=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8,
        moe_intermediate_size=2048, n_routed_experts=n_experts, num_experts_per_tok=6, index_n_heads=64,
        index_head_dim=128, index_topk=512, partial_rotary_factor=0.125, vocab_size=vocab,
        num_hidden_layers=len(layer_types), layer_types=layer_types,
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(layer_types) - 1),
    )  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg, torch.float32).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()]):
            if name.endswith("tid2eid"):
                t.copy_(
                    torch.rand(
                        t.shape[0], n_experts, generator=g, device="cuda"
                    ).argsort(-1)[:, : t.shape[1]]
                )
            elif name.endswith(("layernorm.weight", "norm.weight")):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g, device="cuda"))
            elif name.endswith(
                (
                    "sinks",
                    "e_score_correction_bias",
                    ".base",
                    "hc_base",
                    "position_bias",
                )
            ):
                t.copy_(0.5 * torch.randn(t.shape, generator=g, device="cuda"))
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g, device="cuda"))
            elif name.endswith((".fn", "hc_fn")):
                t.copy_(0.05 * torch.randn(t.shape, generator=g, device="cuda"))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
            else:
                t.copy_(
                    torch.randn(t.shape, generator=g, device="cuda")
                    / math.sqrt(t.shape[-1])
                )
    return model


@pytest.mark.parametrize("lengths", [[2047, 2200, 700], [2200], [2047, 700]])
def test_flash_width_fp32_matches_general_path(lengths) -> None:
    """At V4-Flash width (HCA + CSA layers, D=512, 64 heads, indexer top-512 of more than 512 rows),
    fp32: the graph path's logits equal the general path's within 1e-4 (relative to the largest).
    2047: the first step closes an HCA and a CSA window; 2200: 550 CSA rows; batch 1-2: the GEMV
    kernels (dense projections, experts)."""
    from engine.model.config import CSA, HCA

    model = _flash_width_model([HCA, CSA], n_experts=16, vocab=32000)
    rng = random.Random(3)
    states = [model.new_state() for _ in lengths]
    for st, n in zip(states, lengths):
        model([(st, [rng.randrange(2, 32000) for _ in range(n)])])
    dec = StaticDecoder(model, max_slots=4, max_tokens=2300, use_graphs=True)
    for i, st in enumerate(states):
        dec.load(i, st)
    worst = 0.0
    for _ in range(6):
        toks = [rng.randrange(2, 32000) for _ in lengths]
        want = model([(st, [t]) for st, t in zip(states, toks)])
        got = dec.step(list(range(len(lengths))), toks).float()
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert worst <= 1e-4, worst
    for i, st in enumerate(states):
        assert_states_close(st, dec.export(i), 1e-3)
