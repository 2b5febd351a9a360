"""The V4.1 model on CUDA: fp32 parity with the reference fixtures (and so with the CPU path),
bf16 close to the fp32 truth.

Run on a GPU machine: ``pytest -m gpu tests/engine/model/v41/test_v41_gpu.py`` (the fixtures must
be at ``../shared/fixtures/deepseek_v41`` beside the checkout).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.model.v41.conftest import CASES, fixture_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.model.v41.loader import load_v41_model  # noqa: E402

BAR = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("case", CASES)
def test_cuda_fp32_matches_the_reference(case: str) -> None:
    """The reference's greedy tokens on the GPU (one prefill, then cached decode), and its
    chosen-token logprobs within 1e-4 at nearly every step. A GPU reduction rounds the last bits
    of an activation differently than the CPU, and where one sits on an FP8/FP4 rounding midpoint
    (see ``test_v41_knife_edge``) the stored value moves by one grid step, which moves later
    logprobs by up to ~1e-2 on these random models; such steps are bounded and counted, and a
    greedy pick may differ only where the reference's top-2 margin is inside that bound."""
    ckpt, ref = fixture_case(case)
    model = load_v41_model(ckpt, dtype="float32", device="cuda")
    diffs = []
    for p in ref["prompts"]:
        st = model.new_state()
        logits = model([(st, p["prompt_ids"])])[0]
        for want, want_lp, margin in zip(p["greedy_tokens"], p["greedy_logprobs"], p["top2_margin"]):
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            diffs.append(abs(float(logp[want]) - want_lp))
            # a different pick only where the reference's own runner-up is within that bound
            assert int(logp.argmax()) == want or margin <= 2e-2, (case, want, int(logp.argmax()), margin)
            logits = model([(st, [want])])[0]  # teacher-forced: later steps still compare
    near = sum(d <= BAR for d in diffs) / len(diffs)
    assert max(diffs) <= 1e-2 and near >= 0.9, (case, max(diffs), near)


@pytest.mark.parametrize("case", CASES)
def test_cuda_bf16_as_close_as_cpu_bf16(case: str) -> None:
    """bf16 cannot match fp32 (on these random models FP8/FP4 KV rounding amplifies every bf16
    step), and no bf16 reference exists for V4.1: the GPU's bf16 must stay as close to the fp32
    truth as the same model's bf16 on the CPU (V4's bar against transformers: 2x + 1e-3)."""
    ckpt, ref = fixture_case(case)
    gpu = load_v41_model(ckpt, dtype="bfloat16", device="cuda")
    cpu = load_v41_model(ckpt, dtype="bfloat16")
    err_gpu = err_cpu = 0.0
    for p in ref["prompts"]:
        truth = torch.tensor(p["prompt_last_logits"])
        err_gpu += (gpu([(gpu.new_state(), p["prompt_ids"])])[0].float().cpu() - truth).abs().mean().item()
        err_cpu += (cpu([(cpu.new_state(), p["prompt_ids"])])[0].float() - truth).abs().mean().item()
    assert err_gpu <= 2 * err_cpu + 1e-3, (err_gpu, err_cpu)
