"""The V4.1 fast path (``engine.model.v41.prefill``) against the general path and the fixtures.

Default tests: the fast path's torch parts on the CPU (every kernel's PyTorch reference). The
``gpu`` tests run the Triton kernels: on CUDA directly (``pytest -m gpu`` on the device), and
here in a child pytest under ``TRITON_INTERPRET=1`` (``slow``).
"""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.attention import V41Tuning
from engine.model.v41.loader import load_v41_model
from engine.model.v41.prefill import moe, use_fast
from tests.engine.model.v41.conftest import BAR, CASES, KNIFE_EDGE_BAR, prompt_bar, fixture_case, stepwise_diffs
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEVICE = "cuda" if ON_GPU else "cpu"


def _models(case: str, device: str = "cpu"):
    ckpt, ref = fixture_case(case)
    general = load_v41_model(ckpt, dtype="float32", device=device, tuning=V41Tuning(fast=False))
    fast = load_v41_model(ckpt, dtype="float32", device=device, tuning=V41Tuning(fast=True))
    return general, fast, ref


def test_fast_is_taken_on_cuda_by_default() -> None:
    assert use_fast(None, torch.zeros(1)) is False and use_fast(True, torch.zeros(1)) is True
    if ON_GPU:
        assert use_fast(None, torch.zeros(1, device="cuda")) is True


def _tiny_moe(dtype: torch.dtype, limit: float, device: str = "cpu"):
    """A random ``MoE`` of 8 experts (top-3, H 32, I 16) and 40 tokens for it."""
    from engine.model.v41.config import V41Config
    from engine.model.v41.layers import MoE

    cfg = V41Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, swiglu_limit=limit,
                    num_hidden_layers=4, compress_ratios=(0, 2, 2, 2), kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3),
                    candidate_source_layer_id=1)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    layer = MoE(cfg, dtype)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.5).to(p.dtype)
    return layer.to(device), torch.randn(40, 32, generator=g).to(dtype).to(device)


TILES = ((16, 16, 16, 4, 1), (16, 16, 16, 4, 1))  # (gate|up, down) GemmConfigs for the tiny shapes


def test_fast_moe_fp32_ignores_expert_gemm() -> None:
    """``V41Tuning.expert_gemm`` is for bf16: fp32 keeps the torch GEMMs, bit for bit."""
    layer, x = _tiny_moe(torch.float32, 10.0)
    assert torch.equal(moe(layer, x, TILES), moe(layer, x))


def test_shared_gate_up_is_one_matrix_the_expert_views() -> None:
    """``MoE.shared_gate_up``: w1 over w3 in one matrix, built once, the expert's own weights
    then views of it (its output unchanged, bit for bit)."""
    layer, x = _tiny_moe(torch.float32, 10.0)
    se = layer.shared_experts
    w1, w3, before = se.w1.weight.detach().clone(), se.w3.weight.detach().clone(), se(x)
    both = layer.shared_gate_up()
    assert torch.equal(both, torch.cat([w1, w3])) and layer.shared_gate_up() is both
    assert se.w1.weight.data_ptr() == both.data_ptr() and se.w3.weight.data_ptr() == both[w1.shape[0]].data_ptr()
    assert torch.equal(se(x), before)


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [1.0, 0.0])
def test_fast_moe_triton_expert_gemm_matches_torch(limit: float) -> None:
    """bf16 routed experts through ``kernels.moe_grouped`` (weighted SwiGLU fused into gate|up)
    against the torch GEMMs (``torch._grouped_mm`` on CUDA, per-expert ``F.linear`` under the
    interpreter): the same math in the same rounding order, bf16 ulps apart."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from bench.kernel_helpers import rel_err

    layer, x = _tiny_moe(torch.bfloat16, limit, DEVICE)
    with torch.inference_mode():
        want = moe(layer, x)
        tails = tuple((*t, 8) for t in TILES)  # an expert's last ≤ 8 rows as an 8-row tile
        for tiles in (TILES, (TILES[0], None), (None, TILES[1]), tails):
            got = moe(layer, x, tiles)
            assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 1e-2, tiles


@pytest.mark.parametrize("case", CASES)
def test_fast_prompt_logits_match(case: str) -> None:
    """One-shot prefill: the fixtures' last-position logits and the general path's within 1e-4
    (on a knife-edge prompt, where any other summation order moves one FP8/FP4 rounding, within
    ``prompt_bar``); the routed experts ran grouped (their stacks were built)."""
    general, fast, ref = _models(case)
    for i, p in enumerate(ref["prompts"]):
        want = general([(general.new_state(), p["prompt_ids"])])[0]
        got = fast([(fast.new_state(), p["prompt_ids"])])[0]
        bar = prompt_bar(case, i)
        assert (got - torch.tensor(p["prompt_last_logits"])).abs().max().item() <= bar, (case, i)
        assert (got - want).abs().max().item() <= bar, (case, i)
        assert int(got.argmax()) == p["greedy_tokens"][0], (case, i)
    assert all(layer.ffn.stacks is not None for layer in fast.model.layers)
    assert all(layer.ffn.stacks is None for layer in general.model.layers)


@pytest.mark.parametrize("case", CASES)
def test_fast_cached_decode_gives_the_reference_tokens(case: str) -> None:
    """Chunked prefill (7 tokens) then token-by-token decode through the fast path: the
    reference's greedy tokens, chosen logprobs within the cached bar."""
    _, fast, ref = _models(case)
    for i, p in enumerate(ref["prompts"]):
        st, ids = fast.new_state(), p["prompt_ids"]
        for a in range(0, len(ids), 7):
            logits = fast([(st, ids[a : a + 7])])[0]
        for step, (want, want_lp) in enumerate(zip(p["greedy_tokens"], p["greedy_logprobs"])):
            logp = torch.log_softmax(logits, dim=-1)
            assert int(logp.argmax()) == want, f"{case}[{i}] step {step}"
            assert abs(float(logp[want]) - want_lp) <= prompt_bar(case, i), f"{case}[{i}] step {step}"
            logits = fast([(st, [want])])[0]


def test_fast_batch_of_chunks_matches_the_general_path() -> None:
    """A batch of a fresh prompt and a continued one in one forward: each row as the general path."""
    general, fast, ref = _models("flash_shape")
    a, b = ref["prompts"][0]["prompt_ids"], ref["prompts"][2]["prompt_ids"]
    outs = []
    for model in (general, fast):
        sa, sb = model.new_state(), model.new_state()
        model([(sb, b[:20])])
        outs.append(model([(sa, a), (sb, b[20:])]))
    assert (outs[0] - outs[1]).abs().max().item() <= BAR


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES if ON_GPU else CASES[:1])
def test_fast_kernels_match_the_general_path(case: str) -> None:
    """The fast path with its Triton kernels (CUDA, or the interpreter on the CPU) against the
    general path on the same device, fp32, forward by forward from the general path's state
    (``stepwise_diffs``: a knife edge one path's summation order crosses stays in its step): each
    prompt's logits within its cached bar, and the teacher-forced decode steps within 1e-4 at
    nearly every step, never beyond ``KNIFE_EDGE_BAR``."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    general, fast, ref = _models(case, DEVICE)
    prompts = ref["prompts"] if ON_GPU else ref["prompts"][:1]
    prefill, steps = stepwise_diffs(general, fast, prompts, DEVICE)
    assert all(d <= prompt_bar(case, ref["prompts"].index(p)) for d, p in zip(prefill, prompts)), (case, prefill)
    near = sum(d <= BAR for d in steps) / len(steps)
    assert max(steps) <= KNIFE_EDGE_BAR and near >= 0.95, (case, max(steps), near)


@pytest.mark.slow
def test_fast_kernels_under_the_interpreter() -> None:
    run_gpu_tests_interpreted("tests/engine/model/v41/test_v41_fast.py")


@pytest.mark.gpu
def test_fast_bf16_prefill_as_close_to_fp32_as_the_general_path() -> None:
    """A random 4-layer slice with 64 experts top-6 and a 1K-token prompt (6K expert rows: the
    Triton grouped GEMM of ``kernels.moe_grouped`` in bf16): the fast path's bf16 logits are as
    close to the general path's fp32 ones as the general path's own bf16 (V4's bar: 2x + 1e-3).
    In fp32 a last-bit difference that moves one FP8/FP4 rounding or top-k pick moves that
    position's later logits by up to ~1e-1 on this random model (on the CPU, the fast path's
    torch parts at 1024 tokens: 99.6% same argmax, median row error 5e-5 of the largest logit,
    max 0.11), so fp32 asks the same argmax at >= 97% of the positions and a median row error
    <= 1e-3 of the largest logit (a wrong window or row choice is far off at most positions)."""
    if not ON_GPU:
        pytest.skip("bf16 kernels: CUDA only (the interpreter's bf16 casts truncate)")
    from dataclasses import replace

    from bench.v41_slice_bench import SLICE, _set_tuning, random_slice
    from engine.model.v41.config import V41Config

    cfg = V41Config(
        vocab_size=1024, hidden_size=512, num_attention_heads=16, head_dim=128, q_lora_rank=128, sliding_window=128,
        index_topk=64, candidate_topk_blocks=16, o_groups=4, o_lora_rank=64, moe_intermediate_size=256,
        n_routed_experts=64, **SLICE,
    )  # fmt: skip
    ids = torch.randint(2, cfg.vocab_size, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    model32, _ = random_slice(cfg, DEVICE, torch.float32)
    model16, _ = random_slice(cfg, DEVICE, torch.bfloat16)
    model16.load_state_dict({k: v.to(model16.state_dict()[k].dtype) for k, v in model32.state_dict().items()})  # the same weights, rounded
    logits = {}
    with torch.inference_mode():
        for dtype, model in ((torch.float32, model32), (torch.bfloat16, model16)):
            for fast in (True, False):
                for layer in model.model.layers:
                    _set_tuning(layer, replace(layer.tuning, fast=fast))
                logits[dtype, fast] = model([(model.new_state(), ids)], logits="all").float()
    truth = logits[torch.float32, False]
    scale = truth.abs().max().item()
    fast32 = logits[torch.float32, True]
    assert (fast32.argmax(-1) == truth.argmax(-1)).float().mean().item() >= 0.97
    assert (fast32 - truth).abs().amax(-1).median().item() <= 1e-3 * scale
    err_fast = (logits[torch.bfloat16, True] - truth).abs().mean().item()
    err_general = (logits[torch.bfloat16, False] - truth).abs().mean().item()
    assert err_fast <= 2 * err_general + 1e-3, (err_fast, err_general)
