"""Memory by bytes: the state pool accounts a sequence by its real V4 state bytes, a context is
admitted when its bytes fit the budget (a 1M-token one on the tiny model included) and refused at
once, naming the bytes, when they never can; on a GPU the budget is measured after the weights,
slot pools and CUDA graphs (``engine.runtime.memory``)."""

from __future__ import annotations

import pytest
import torch

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.errors import ContextLengthExceeded
from engine.runtime.builder import build_engine, fit_state_budget
from engine.runtime.config import EngineConfig
from engine.runtime.state_pool import StatePool, state_bytes
from tests.engine.runtime.helpers import prompt

MILLION = 1 << 20


@pytest.mark.parametrize("n", [1, 3, 4, 127, 128, 129, 300, 512])
def test_accounted_bytes_cover_the_real_state(tiny_model, n: int) -> None:
    """After a prefill of ``n`` tokens the state's tensors (window rows, compressed and indexer rows,
    compressor buffers and overlaps) fit the bytes the pool accounts for ``n`` tokens, with at most
    one unit of blocks and one boundary to spare."""
    pool = StatePool(tiny_model.config, tiny_model.dtype, 1 << 30, max_seqs=1)
    state = tiny_model.new_state()
    tiny_model([(state, prompt(n, n))])
    real = state.nbytes()
    assert real <= pool.bytes_for(n) <= real + pool.block_bytes + pool.boundary_bytes


def _engine(tiny_model, tiny_model_dir, budget_units: int, **cfg):
    block, boundary = state_bytes(tiny_model.config, tiny_model.dtype)
    config = EngineConfig(max_num_seqs=2, max_model_len=MILLION + 64, state_memory_bytes=2 * boundary + budget_units * block, static_decode=False, **cfg)
    return build_engine(tiny_model_dir, config, model=tiny_model)


def test_million_token_context_admitted_when_its_bytes_fit(tiny_model, tiny_model_dir) -> None:
    units = -(-(MILLION + 16) // tiny_model.config.unit_tokens)
    engine = _engine(tiny_model, tiny_model_dir, units)
    assert engine.pool.max_tokens >= MILLION + 16
    engine.add_request(GenerateRequest("long", prompt(MILLION, 1), SamplingParams(max_tokens=16)))
    out = engine.scheduler.schedule()  # admitted: its first prefill chunk is scheduled
    assert [(s.request_id, n) for s, n in out.scheduled] == [("long", engine.config.max_num_batched_tokens)]


def test_context_whose_bytes_never_fit_is_refused_clearly(tiny_model, tiny_model_dir) -> None:
    units = -(-(MILLION + 16) // tiny_model.config.unit_tokens)
    engine = _engine(tiny_model, tiny_model_dir, units - 1)
    with pytest.raises(ContextLengthExceeded, match=r"bytes of sequence state.*at most \d+ tokens per sequence"):
        engine.add_request(GenerateRequest("long", prompt(MILLION, 1), SamplingParams(max_tokens=16)))
    assert not engine.has_work()
    engine.add_request(GenerateRequest("short", prompt(50, 2), SamplingParams(max_tokens=4)))  # still serving


def test_cpu_budget_split_over_cores(tiny_model, tiny_model_dir) -> None:
    cores = [_engine(tiny_model, tiny_model_dir, 40) for _ in range(2)]
    whole = cores[0].config.state_memory_bytes
    fit_state_budget(cores, tiny_model, cores[0].config)
    assert all(c.config.state_memory_bytes == whole // 2 and c.pool.capacity_bytes <= whole // 2 for c in cores)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_budget_measured_after_graphs(tmp_path) -> None:
    """On CUDA the budget is what ``gpu_memory_utilization`` leaves once the native weights, the
    slot pools, every bucket's graph and a full step's prefill are allocated."""
    from engine.model.random_checkpoint import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "v4-flash-narrow", layers=4, device="cuda")
    engine = build_engine(ckpt, EngineConfig(max_num_seqs=8, gpu_memory_utilization=0.5, weights="native"), dtype="bfloat16", device="cuda")
    assert sorted(engine.static.decoder._graphs) == list(engine.static.decoder.buckets)
    free, total = torch.cuda.mem_get_info()
    budget = engine.config.state_memory_bytes
    assert abs(budget - (0.5 * total - (total - free))) < 64 << 20, (budget, free, total)
    assert engine.pool.capacity_bytes <= budget
