"""What each rank runs in the expert-parallel engine tests: 2 processes over gloo (or NCCL), each
an ``EPRankBackend`` (the rank of ``deepserve engine --ep 2``) driven through the engine API.

Two phases, back to back in one group: ``idle`` (only rank 0 has requests; rank 1 joins every
step with no rows) and ``mixed`` (both ranks, mixed lengths, one prompt long enough for chunked
prefill, rank 1's requests arriving a few steps late). Each rank writes its greedy tokens.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import time

import torch.distributed as dist

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.config import EngineConfig

CONFIG = EngineConfig(max_num_batched_tokens=96, max_num_seqs=4, max_model_len=1024, kv_cache="off", static_max_tokens=512, state_memory_bytes=64 << 20)
MAX_TOKENS = 6
# phase -> rank -> [(request id, prompt length, step it arrives at)]
PLAN = {
    "idle": {0: [("i0", 9, 0), ("i1", 40, 0)], 1: []},
    "mixed": {0: [("m0", 3, 0), ("m1", 300, 0), ("m2", 17, 4)], 1: [("m3", 130, 3), ("m4", 5, 3), ("m5", 1, 9)]},
}


def prompt(rid: str, n: int, vocab: int) -> list[int]:
    """The prompt of request ``rid`` (the same ids in the one-process reference run)."""
    rng = random.Random(rid)
    return [rng.randrange(2, vocab) for _ in range(n)]


def request(rid: str, n: int, vocab: int) -> GenerateRequest:
    return GenerateRequest(rid, prompt(rid, n, vocab), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def run(rank: int, world: int, init: str, model_dir: str, backend: str, dtype: str, config: EngineConfig, out: str) -> None:
    import faulthandler

    from engine.backends.base import BackendContext
    from engine.backends.reference.ep_rank import build_rank
    from engine.parallel.group import ExpertGroup

    faulthandler.dump_traceback_later(100, exit=True)  # a hung collective: print where, then exit
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    ctx = BackendContext(model_dir=model_dir, dtype=dtype, device=device, engine=config)
    t0 = time.perf_counter()
    be, _ = build_rank(ctx, ExpertGroup(), device)
    built = time.perf_counter() - t0
    vocab = be.core.model.config.vocab_size
    tokens: dict[str, list[int]] = {}
    report: dict = {"rank": rank, "tokens": tokens, "local_experts": be.core.model.model.layers[0].mlp.experts.ep_count, "build_s": built}
    t0 = time.perf_counter()
    for phase, plan in PLAN.items():
        arrivals = sorted(plan[rank], key=lambda a: a[2])
        last = max(a[2] for reqs in plan.values() for a in reqs)  # the same on every rank
        step = joined = 0
        while True:
            while arrivals and arrivals[0][2] <= step:
                rid, n, _ = arrivals.pop(0)
                be.add_request(request(rid, n, vocab))
            idle_here = not be.core.has_work()
            for ev in be.step():
                assert ev.error is None, ev
                tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            joined += int(idle_here and be.group_busy)
            step += 1
            if step > last and not be.group_busy:  # agreed: every rank leaves in the same turn
                break
        report[f"{phase}_steps"] = step
        report[f"{phase}_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        report[f"{phase}_joined_idle"] = joined
    report["static_steps"] = be.core.static.steps if be.core.static is not None else 0
    with open(out, "w") as f:
        json.dump(report, f)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    if backend == "nccl":  # NCCL in live CUDA graphs hangs destroy_process_group (ep_worker.py): results are written
        os._exit(0)
    dist.destroy_process_group()


def spawn(tmp_path, model_dir, backend: str = "gloo", dtype: str = "float32", config: EngineConfig = CONFIG) -> list[dict]:
    """Run ``run`` on 2 spawned ranks (``backend`` gloo on CPU, nccl on cuda:0/1); their reports."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'ep_engine_init'}"
    outs = [str(tmp_path / f"ep_engine_rank{r}.json") for r in range(2)]
    mp.start_processes(_entry, args=(2, init, str(model_dir), backend, dtype, config, outs), nprocs=2, join=True, start_method="spawn")
    return [json.load(open(p)) for p in outs]


def _entry(rank, world, init, model_dir, backend, dtype, config, outs):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(rank, world, init, model_dir, backend, dtype, config, outs[rank])
