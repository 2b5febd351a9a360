"""The expert-parallel engine on 2 GPUs (NCCL, one rank process per GPU, as ``deepserve engine
--device cuda --ep 2`` runs them) against one plain engine on one GPU, the plan of
``ep_engine_ranks`` (both ranks, mixed lengths, chunked prefill, an idle rank). fp32 on the
general path: the same greedy tokens; bf16 with the slot decoders' CUDA graphs (the all-to-alls
captured): as close as the kernels' roundings allow. Run: ``pytest -m gpu`` on 2 GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from tests.engine.parallel.ep_engine_ranks import CONFIG, PLAN, request, spawn

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)


def _plain(model_dir, dtype: str, config: EngineConfig) -> dict[str, list[int]]:
    core = build_engine(model_dir, config, dtype=dtype, device="cuda:0")
    vocab = core.model.config.vocab_size
    for plan in PLAN.values():
        for reqs in plan.values():
            for rid, n, _ in reqs:
                core.add_request(request(rid, n, vocab))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for ev in core.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out


def test_ep_engine_two_gpus_fp32_equals_one_gpu(tmp_path, small_windows_model_dir) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = replace(CONFIG, static_decode=False)
    ranks = spawn(tmp_path, small_windows_model_dir, "nccl", "float32", cfg)
    assert {**ranks[0]["tokens"], **ranks[1]["tokens"]} == _plain(small_windows_model_dir, "float32", cfg)


def test_ep_engine_two_gpus_bf16_graphs_close_to_one_gpu(tmp_path, tiny_model_dir) -> None:
    ranks = spawn(tmp_path, tiny_model_dir, "nccl", "bfloat16", CONFIG)
    got = {**ranks[0]["tokens"], **ranks[1]["tokens"]}
    want = _plain(tiny_model_dir, "bfloat16", CONFIG)
    assert sorted(got) == sorted(want) and all(r["static_steps"] > 0 for r in ranks)
    same = sum(a == b for rid in want for a, b in zip(got[rid], want[rid]))
    assert same >= 0.9 * sum(len(v) for v in want.values()), (got, want)
