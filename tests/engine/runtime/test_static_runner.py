"""Decode through the static runner (StaticDecoder slots) inside the engine, against the
general path: same tokens and logprobs, slots freed on finish, abort and preemption, KV saves
from slotted sequences equal to the general path's (CPU, fp32, no CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.state_pool import state_bytes
from tests.engine.runtime.helpers import greedy, prompt, run

LENGTHS = [5, 300, 40, 129, 17, 64, 250, 8]


def _engine(tiny_model, tiny_model_dir, static: bool, **cfg):
    return build_engine(tiny_model_dir, EngineConfig(static_decode=static, static_max_tokens=400, **cfg), model=tiny_model)


def test_static_decode_matches_general_path(tiny_model, tiny_model_dir) -> None:
    reqs = [GenerateRequest(f"r{i}", prompt(n, 40 + i), greedy(20)) for i, n in enumerate(LENGTHS)]
    reqs.append(GenerateRequest("s", prompt(90, 7), SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True)))
    reqs.append(GenerateRequest("long", prompt(385, 8), greedy(30)))  # outgrows the 400-token slot
    general = run(_engine(tiny_model, tiny_model_dir, False, max_num_batched_tokens=512), reqs)
    engine = _engine(tiny_model, tiny_model_dir, True, max_num_batched_tokens=512)
    static = run(engine, reqs)
    assert engine.static is not None and engine.static.steps > 0
    for r in reqs:
        assert static[r.request_id].tokens == general[r.request_id].tokens, r.request_id
        assert max((abs(a - b) for a, b in zip(static[r.request_id].logprobs, general[r.request_id].logprobs)), default=0) < 1e-4
    assert len(engine.static._free) == engine.config.max_num_seqs  # every slot back


def test_static_slots_freed_on_abort_and_preemption(tiny_model, tiny_model_dir) -> None:
    block, boundary = state_bytes(tiny_model.config, tiny_model.dtype)
    engine = _engine(tiny_model, tiny_model_dir, True, max_num_seqs=4, state_memory_bytes=4 * boundary + 5 * block, max_num_batched_tokens=256)
    reqs = [GenerateRequest(f"p{i}", prompt(n, 60 + i), greedy(40)) for i, n in enumerate((120, 130, 125, 140))]
    ref = {r.request_id: run(_engine(tiny_model, tiny_model_dir, False), [r])[r.request_id].tokens for r in reqs}
    out = run(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    assert {k: v.tokens for k, v in out.items()} == ref
    assert len(engine.static._free) == 4
    engine.add_request(GenerateRequest("a", prompt(50, 1), greedy(30)))
    for _ in range(5):
        engine.step()
    assert engine.static.holds(engine.seqs["a"])
    assert engine.abort_request("a")
    engine.step()
    assert len(engine.static._free) == 4 and not engine.has_work()


class RecordingKV:
    """A KV connector that records the states it is asked to save at unit boundaries."""

    unit = 128

    def __init__(self) -> None:
        self.saved: dict[tuple[str, int], list[torch.Tensor]] = {}

    def restore(self, seq, model) -> None:
        seq.kv_checked = True

    def snapshot_stop(self, seq):
        return None

    def save_due(self, seq) -> bool:
        return seq.num_computed % self.unit == 0 and seq.num_computed > 0

    def save(self, seq, model) -> None:
        if seq.state is None or not self.save_due(seq):
            return
        self.saved[(seq.request_id, seq.num_computed)] = [layer.swa.clone() for layer in seq.state.layers]

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass


def test_kv_saves_from_static_slots_equal_general(tiny_model, tiny_model_dir) -> None:
    reqs = [GenerateRequest(f"k{i}", prompt(n, 80 + i), greedy(40)) for i, n in enumerate((100, 120))]
    saves = []
    for static in (False, True):
        kv = RecordingKV()
        engine = build_engine(tiny_model_dir, EngineConfig(static_decode=static, static_max_tokens=400), model=tiny_model, kv=kv)
        run(engine, reqs)
        saves.append(kv.saved)
    assert saves[0].keys() == saves[1].keys() and any(n > 120 for _, n in saves[0])  # decode-time saves
    for key in saves[0]:
        for a, b in zip(saves[0][key], saves[1][key]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_decode_with_cuda_graphs_matches_general_path(tiny_model_dir) -> None:
    """On GPU the runner is on by default (CUDA graphs per batch bucket): fp32 tokens and
    logprobs as the general path's."""
    from engine.model.loader import load_model

    model = load_model(tiny_model_dir, dtype="float32", device="cuda", progress=False)
    reqs = [GenerateRequest(f"g{i}", prompt(n, 90 + i), greedy(24)) for i, n in enumerate(LENGTHS)]
    general = run(build_engine(tiny_model_dir, EngineConfig(static_decode=False), device="cuda", model=model), reqs)
    engine = build_engine(tiny_model_dir, EngineConfig(static_max_tokens=1024), device="cuda", model=model)
    static = run(engine, reqs)
    assert engine.static is not None and engine.static.decoder.use_graphs and engine.static.steps > 0
    for r in reqs:
        assert static[r.request_id].tokens == general[r.request_id].tokens, r.request_id
        assert max(abs(a - b) for a, b in zip(static[r.request_id].logprobs, general[r.request_id].logprobs)) < 1e-3
