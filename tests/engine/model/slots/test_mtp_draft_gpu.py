"""The slot MTP draft step on CUDA: fp32 drafts equal the general path's (``mtp.Drafter``), and
the CUDA-graph replay (bf16) gives the drafts of the same step run without graphs; through the
engine, speculative decoding with the slots' CUDA graphs gives the plain engine's tokens.

Run on a GPU machine: ``pytest -m gpu tests/engine/model/slots/test_mtp_draft_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.model.loader import load_model
from engine.model.mtp import DraftState, MTPLayer
from engine.model.slots.mtp_draft import SlotDrafter
from engine.model.state import LayerState
from tests.engine.model.slots.test_mtp_draft import run_drafts


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("k", [1, 3])
def test_fp32_slot_drafts_equal_the_general_paths_on_cuda(small_windows_model_dir, k: int) -> None:
    model = load_model(small_windows_model_dir, dtype="float32", device="cuda", progress=False)
    run_drafts(model, MTPLayer.from_model(model), k=k, rounds=6, seed=k, compiled=False)  # fp32: no graphs (SlotDrafter)


@pytest.mark.parametrize("k", [1, 3])
def test_graph_replay_gives_the_eager_steps_drafts(trained_mtp_model_dir, k: int) -> None:
    """Buckets 1 and 16 (the eager step runs the same shapes): the very drafts and ring; 3 slots
    in bucket 4 (padded, so other GEMM shapes than the eager 3 rows): bf16-close."""
    model = load_model(trained_mtp_model_dir, dtype="bfloat16", device="cuda", progress=False)
    layer = MTPLayer.from_model(model)
    g = torch.Generator().manual_seed(k)
    drafters = [SlotDrafter(model, layer, 16, k, (1, 2, 4, 8, 16), use_graphs=u) for u in (True, False)]
    w, d = layer.block.self_attn.window, model.config.head_dim
    same = total = 0
    for n in (1, 3, 16):
        windows = [torch.randn(w - 1 - s, d, generator=g).to("cuda", torch.bfloat16) for s in range(n)]
        for dr in drafters:  # the very same windows in both pools
            for s, swa in enumerate(windows):
                dr.pool.load(s, DraftState(LayerState(swa=swa.clone()), 200 + s))
        rng = torch.Generator().manual_seed(n)
        for _ in range(3):
            streams = torch.randn(n, k + 1, model.config.hc_mult, model.config.hidden_size, generator=rng).to("cuda", torch.bfloat16)
            kept = torch.randint(1, k + 2, (n,), generator=rng).tolist()
            ids = [torch.randint(2, 129280, (c,), generator=rng).tolist() for c in kept]
            graph, eager = (dr.draft(list(range(n)), streams, ids) for dr in drafters)
            if n != 3:
                assert graph == eager
            same += sum(a == b for x, y in zip(graph, eager) for a, b in zip(x, y))
            total += n * k
        rings = [dr.pool.ring[:n].float() for dr in drafters]
        if n != 3:
            assert torch.equal(rings[0], rings[1])  # the fed keys, and the chained entries' rows restored
        else:
            torch.testing.assert_close(rings[0], rings[1], rtol=0.05, atol=0.05)
    assert same >= 0.9 * total and set(drafters[0]._graphs) == {1, 4, 16}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_with_slot_drafts(trained_mtp_model_dir, dtype: str) -> None:
    """fp32 (the slot decoder's graphs, the draft step without): the plain engine's tokens;
    bf16 (both in graphs): drafts accepted (a verify's batched rounding may flip a bf16 token)."""
    from deepserve.protocol import GenerateRequest, SamplingParams
    from engine.model.tiny_mtp import TrainConfig, sentence
    from engine.runtime.builder import build_engine
    from engine.runtime.config import EngineConfig, SpeculativeConfig

    model = load_model(trained_mtp_model_dir, dtype=dtype, device="cuda", progress=False)
    lang = TrainConfig()
    reqs = lambda: [GenerateRequest(f"r{i}", sentence(lang, 1000 + i, 3 + 20 * i), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(4)]  # noqa: E731

    def run(engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in reqs():
            engine.add_request(r)
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        return out

    base = run(build_engine(trained_mtp_model_dir, EngineConfig(max_num_seqs=8), model=model))
    engine = build_engine(trained_mtp_model_dir, EngineConfig(max_num_seqs=8, speculative=SpeculativeConfig("mtp", 3)), model=model)
    out = run(engine)
    drafter = engine.spec.slot_drafter
    assert drafter is not None and drafter.steps > 0 and drafter.use_graphs == (dtype == "bfloat16")
    if dtype == "float32":
        assert out == base
    else:  # the language's continuation: most tokens agree, and drafts are accepted (> 2 tokens a step)
        agree = sum(a == b for r in base for a, b in zip(base[r], out[r])) / sum(len(v) for v in base.values())
        assert agree > 0.5 and 40 * 4 / engine.static.steps > 2, (agree, engine.static.steps)
