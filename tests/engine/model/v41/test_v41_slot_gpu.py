"""The V4.1 slot decoder on CUDA: captured CUDA graphs give the same steps as the general path
(fp32 within 1e-4 at nearly every step, as ``test_v41_gpu``'s bar), and bf16 graphs replay the
eager slot step.

Run on a GPU machine: ``pytest -m gpu tests/engine/model/v41/test_v41_slot_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.model.v41.conftest import BAR, CASES, fixture_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.model.v41.loader import load_v41_model  # noqa: E402
from engine.model.v41.slot_decode import V41SlotDecoder  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _prefilled(model, prompts):
    states = []
    for p in prompts:
        st = model.new_state()
        model([(st, p["prompt_ids"])])
        states.append(st)
    return states


@pytest.mark.parametrize("alone", [False, True], ids=["batch", "alone"])
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_graphs_match_the_general_path_fp32(case: str, kernels: bool, alone: bool) -> None:
    """Teacher-forced steps of every prompt, chosen-token logprobs against the general path on the
    same GPU. PyTorch ops (``kernels=False``): within 1e-4 at every step. Through the Triton
    kernels, whose fp32 sums run in another order: a value on an FP8/FP4 rounding midpoint can land
    on the other side (``test_v41_knife_edge``) and move later logprobs of that prompt, so the same
    greedy picks where the reference's margin exceeds that bound, every step within 1e-2, most
    within 1e-4. ``alone``: the first prompt at batch 1, where the kernels' dense projections and
    lm_head run through ``kernels.gemv``."""
    ckpt, ref = fixture_case(case)
    model = load_v41_model(ckpt, dtype="float32", device="cuda")
    prompts = ref["prompts"][:1] if alone else ref["prompts"]
    general = _prefilled(model, prompts)
    dec = V41SlotDecoder(model, max_slots=4, max_tokens=max(len(p["prompt_ids"]) for p in prompts) + STEPS + 1, kernels=kernels)
    assert dec.use_graphs
    slots = [3, 1, 2][: len(prompts)]
    for s, st in zip(slots, general):
        dec.load(s, st.clone())
    diffs = []
    for k in range(STEPS):
        feed = [p["greedy_tokens"][k] for p in prompts]
        want = torch.log_softmax(model([(st, [t]) for st, t in zip(general, feed)]).float(), -1)
        got = torch.log_softmax(dec.step(slots, feed).float(), -1)
        nxt = [p["greedy_tokens"][k + 1] for p in prompts]
        diffs += [abs(float(got[j, t] - want[j, t])) for j, t in enumerate(nxt)]
        for j, p in enumerate(prompts):
            assert int(got[j].argmax()) == int(want[j].argmax()) or p["top2_margin"][k + 1] <= 2e-2, (case, k, j)
    near = sum(d <= BAR for d in diffs) / len(diffs)
    if not kernels:
        assert max(diffs) <= BAR, (case, max(diffs))
    assert max(diffs) <= 1e-2 and near >= 0.5, (case, max(diffs), near)


@pytest.mark.parametrize("alone", [False, True], ids=["batch", "alone"])
@pytest.mark.parametrize("case", CASES)
def test_bf16_graphs_replay_the_eager_step(case: str, alone: bool) -> None:
    ckpt, ref = fixture_case(case)
    model = load_v41_model(ckpt, dtype="bfloat16", device="cuda")
    prompts = ref["prompts"][:1] if alone else ref["prompts"]
    states = _prefilled(model, prompts)
    n = max(len(p["prompt_ids"]) for p in prompts) + STEPS + 1
    graphs, eager = V41SlotDecoder(model, 4, n), V41SlotDecoder(model, 4, n, use_graphs=False)
    graphs.capture_graphs()
    for s, st in enumerate(states):
        graphs.load(s, st)
        eager.load(s, st)
    for k in range(STEPS):
        feed = [p["greedy_tokens"][k] for p in prompts]
        a = graphs.step(list(range(len(prompts))), feed).clone()
        b = eager.step(list(range(len(prompts))), feed)
        assert torch.equal(a, b), (case, k)


def test_engine_on_cuda_decodes_through_the_slots() -> None:
    """``build_engine`` on CUDA decodes V4.1 in ``V41SlotDecoder`` (graphs captured at warm-up)
    with the general engine's greedy tokens and logprobs (fp32). The engine needs xgrammar."""
    pytest.importorskip("xgrammar")
    from deepserve.protocol import GenerateRequest
    from engine.runtime.builder import build_engine
    from engine.runtime.config import EngineConfig
    from tests.engine.runtime.helpers import greedy, run

    ckpt, ref = fixture_case("flash_shape")
    reqs = [GenerateRequest(f"r{i}", p["prompt_ids"], greedy(12)) for i, p in enumerate(ref["prompts"])]
    general = run(build_engine(ckpt, EngineConfig(static_decode=False), dtype="float32", device="cuda"), reqs)
    engine = build_engine(ckpt, EngineConfig(static_max_tokens=256), dtype="float32", device="cuda")
    assert isinstance(engine.static.decoder, V41SlotDecoder) and engine.static.decoder._graphs
    slotted = run(engine, reqs)
    assert engine.static.steps > 0
    for r in reqs:
        assert slotted[r.request_id].tokens == general[r.request_id].tokens, r.request_id
        assert max(abs(a - b) for a, b in zip(slotted[r.request_id].logprobs, general[r.request_id].logprobs)) < 1e-3
