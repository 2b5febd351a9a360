"""The V4.1 slot decoder (``engine/model/v41/slot_decode.py``) against the general path on CPU in
fp32: the same greedy tokens and chosen-token logprobs within 1e-4 at every decode step of every
fixture prompt, all prompts of a case stepping together (mixed lengths, a padded bucket), across
window and compressor-group boundaries; ``export`` gives back the general path's state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepserve.protocol import GenerateRequest
from engine.model.slots import SlotDecoder
from engine.model.v41.loader import load_v41_model
from engine.model.v41.slot_decode import V41SlotDecoder
from engine.runtime.builder import build_engine, build_sampler, family_engine_config
from engine.runtime.config import EngineConfig
from engine.runtime.engine_core import EngineCore
from tests.engine.model.v41.conftest import BAR, CASES, fixture_case
from tests.engine.runtime.helpers import greedy, run

STEPS = 12  # decode steps per prompt: past W = 8 / 16 ring rows and several groups of 2


def _same_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """The slot step's stored FP8/FP4 values are the general path's, but for the rare value on a
    rounding midpoint that the batched step's last bits send to the other side (the CPU's BLAS
    and vector widths set the summation order: under ATen's AVX2 kernels one window entry of
    flash_shape flips, 1 of 960): at most 1 in 500 entries."""
    assert got.shape == want.shape
    assert (got != want).float().mean().item() <= 2e-3, int((got != want).sum())


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("alone", [False, True], ids=["batch", "alone"])
@pytest.mark.parametrize("case", CASES)
def test_slot_steps_match_the_general_path(case: str, alone: bool) -> None:
    """Every prompt of the case as one batch, and the first alone (batch 1)."""
    ckpt, ref = fixture_case(case)
    model = load_v41_model(ckpt, dtype="float32", device="cpu")
    prompts = ref["prompts"][:1] if alone else ref["prompts"]
    general, slotted = [], []
    for p in prompts:
        st = model.new_state()
        model([(st, p["prompt_ids"])])
        general.append(st)
        slotted.append(st.clone())
    longest = max(len(p["prompt_ids"]) for p in prompts)
    dec = V41SlotDecoder(model, max_slots=len(prompts) + 1, max_tokens=longest + STEPS + 1)
    slots = [len(prompts) - i for i in range(len(prompts))]  # not in order, slot 0 unused: a padded bucket
    for s, st in zip(slots, slotted):
        dec.load(s, st)
    worst = 0.0
    for k in range(STEPS):
        feed = [p["greedy_tokens"][k] for p in prompts]  # teacher-forced: the reference's picks
        want = _logprobs(model([(st, [t]) for st, t in zip(general, feed)]))  # (n, V)
        got = _logprobs(dec.step(slots, feed))
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (case, k)
        worst = max(worst, float((got - want).abs().max()))
        if k == STEPS // 2:  # export, and a fresh decoder continues from the exported states
            for s, st in zip(slots, general):
                out = dec.export(s)
                assert out.num_tokens == st.num_tokens and out.token_ids == st.token_ids and out.engram == st.engram
                for a, b in zip(out.windows, st.windows):
                    _same_codes(a, b)
                for i, src in st.sources.items():
                    _same_codes(out.sources[i].rows, src.rows)
                    # fp32 projections of the open group: last bits of the batched step's activations
                    torch.testing.assert_close(out.sources[i].buf_kv, src.buf_kv, rtol=1e-4, atol=1e-5)
                    assert (src.keys is None) == (out.sources[i].keys is None)
                    if src.keys is not None:
                        _same_codes(out.sources[i].keys, src.keys)
            moved = V41SlotDecoder(model, max_slots=len(prompts), max_tokens=dec.max_tokens)
            for s, st in enumerate(dec.export(s) for s in slots):
                moved.load(s, st)
            dec, slots = moved, list(range(len(prompts)))
    assert worst <= BAR, (case, worst)


@pytest.mark.parametrize("case", CASES)
def test_the_up_front_indices_are_every_index_a_step_asks(case: str) -> None:
    """``_indices`` computes every ``_once`` tensor of a step before the layers run (on CUDA on a
    side stream, joined before the first attention): a step adds no index tensor of its own,
    which could otherwise be made on one side stream and read on another."""
    ckpt, ref = fixture_case(case)
    model = load_v41_model(ckpt, dtype="float32", device="cpu")
    p = ref["prompts"][0]
    st = model.new_state()
    model([(st, p["prompt_ids"])])
    dec = V41SlotDecoder(model, max_slots=2, max_tokens=len(p["prompt_ids"]) + 4)
    dec.load(1, st)
    dec.step([1], [p["prompt_ids"][-1]])
    asked = set(dec._memo)
    dec._memo = {}
    ids, pos, slots = dec._inputs[:, :1]
    dec._indices(pos, slots)
    assert asked and set(dec._memo) == asked


def test_the_decoder_makes_every_expert_weight_view_before_it_captures() -> None:
    """The routed stacks and the shared experts' gate|up exist once a decoder is built, its
    experts' parameters views of them: a later CUDA prefill (``prefill._shared_expert``) moves no
    weight a captured graph reads (run 63: it did, and the engine's slot decode went wrong)."""
    ckpt, _ = fixture_case("tester")
    model = load_v41_model(ckpt, dtype="float32", device="cpu")
    V41SlotDecoder(model, max_slots=2, max_tokens=16)
    for layer in model.model.layers:
        moe, se = layer.ffn, layer.ffn.shared_experts
        assert moe.stacks is not None and moe.experts[0].w1.weight.data_ptr() == moe.stacks[0].data_ptr()
        assert moe.shared_stack is not None and se.w1.weight.data_ptr() == moe.shared_stack.data_ptr()
        before = [p.data_ptr() for p in moe.parameters()]
        moe.stack(), moe.shared_gate_up()  # what a prefill calls: nothing moves
        assert [p.data_ptr() for p in moe.parameters()] == before


def test_load_refuses_states_the_slots_cannot_hold() -> None:
    ckpt, _ = fixture_case("tester")
    model = load_v41_model(ckpt, dtype="float32", device="cpu")
    dec = V41SlotDecoder(model, max_slots=2, max_tokens=16)
    st = model.new_state()
    model([(st, list(range(2, 18)))])
    with pytest.raises(ValueError, match="no room"):
        dec.load(0, st)
    short = model.new_state()
    model([(short, [2, 3, 4])])
    short.decoder_from = 2
    with pytest.raises(ValueError, match="bounded-replay"):
        dec.load(0, short)
    short.decoder_from = 0
    dec.load(0, short)
    with pytest.raises(ValueError, match="each slot once"):
        dec.step([0, 0], [5, 6])
    assert dec.nbytes() > 0
    assert isinstance(dec, SlotDecoder)  # the runtime's slot decode interface
    dec.capture_graphs()  # no graphs on CPU: a no-op


def test_engine_decodes_v41_through_the_slots() -> None:
    """The engine's static runner picks ``V41SlotDecoder`` for a V4.1 model (on CPU only when
    asked for: ``family_engine_config`` keeps the general path there) and gives the general
    engine's greedy tokens and logprobs on a mixed batch."""
    ckpt, ref = fixture_case("flash_shape")
    model = load_v41_model(ckpt, dtype="float32", device="cpu")
    reqs = [GenerateRequest(f"r{i}", p["prompt_ids"], greedy(10)) for i, p in enumerate(ref["prompts"])]
    general = run(build_engine(ckpt, EngineConfig(), model=model), reqs)
    assert family_engine_config(model, EngineConfig()).static_decode is False
    engine = EngineCore(model, build_sampler(model, ckpt), EngineConfig(static_decode=True, static_max_tokens=128))
    assert isinstance(engine.static.decoder, V41SlotDecoder)
    slotted = run(engine, reqs)
    assert engine.static.steps > 0 and len(engine.static._free) == engine.config.max_num_seqs
    for r in reqs:
        assert slotted[r.request_id].tokens == general[r.request_id].tokens, r.request_id
        assert max(abs(a - b) for a, b in zip(slotted[r.request_id].logprobs, general[r.request_id].logprobs)) < BAR


@pytest.mark.slow
def test_kernel_path_under_interpreter() -> None:
    """The step through ``kernels.v41_attention`` / ``kernels.v41_indexer`` (the CUDA path) on
    CPU under Triton's interpreter: the same comparison with the general path (~40 s), batched only: a lone step's lm_head through
    ``kernels.gemv`` is ~32K interpreted programs (``test_v41_slot_gpu`` runs it)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("already under the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "test_slot_steps_match_the_general_path and batch"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[4], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
