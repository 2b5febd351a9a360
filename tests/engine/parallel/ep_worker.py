"""The expert-parallel check run by each rank (CPU gloo test and the 2-GPU NCCL test).

Each rank loads the same checkpoint twice: a full model (the one-GPU truth: the general path, and
in bf16 also one-GPU ``StaticDecoder``) and a model whose experts ``EPDecoder`` cuts to its half.
Both ranks prefill their own sequences with the full model and load them into their EP slots, then
decode a fixed schedule of uneven steps (a rank with 0 sequences in some) and compare logits.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys

import torch
import torch.distributed as dist

# per rank: prompt lengths; per step: which of the rank's sequences decode
LENGTHS = {0: [3, 17, 130], 1: [5, 128]}
SCHEDULE = [
    {0: [0, 1, 2], 1: [0, 1]},
    {0: [1], 1: []},
    {0: [], 1: [0, 1]},
    {0: [0, 2], 1: [1]},
    {0: [0, 1, 2], 1: [0]},
    {0: [2], 1: [0, 1]},
]


def run(rank: int, world: int, init: str, model_dir: str, backend: str, dtype: str, use_graphs: bool, out: str) -> None:
    from engine.model.loader import load_model
    from engine.model.static_decode import StaticDecoder
    from engine.parallel.ep import EPDecoder

    import faulthandler

    faulthandler.dump_traceback_later(80, exit=True)  # a hung collective: print where, then exit
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    full = load_model(model_dir, dtype=dtype, device=device, progress=False)
    sharded = load_model(model_dir, dtype=dtype, device=device, progress=False)
    rng = random.Random(100 + rank)
    vocab = full.config.vocab_size
    lengths = LENGTHS[rank]
    states = [full.new_state() for _ in lengths]
    full([(st, [rng.randrange(2, vocab) for _ in range(n)]) for st, n in zip(states, lengths)])
    ep = EPDecoder(sharded, max_slots=4, max_tokens=300, use_graphs=use_graphs)
    one = StaticDecoder(full, max_slots=4, max_tokens=300, use_graphs=use_graphs) if dtype != "float32" else None
    if one is not None:
        # the same expert kernels as EP's (no one-token GEMV experts): in bf16 the GEMV's other
        # roundings flip a near-tied top-k pick of the tiny random model at some steps (0.2 of
        # the logits' scale; fp32 equal to 1e-4), which is not what this test compares
        one.gemv_experts = False
    for i, st in enumerate(states):
        ep.load(i, st)
        if one is not None:
            one.load(i, st)
    worst = worst_one = 0.0
    agree = total = 0
    steps = 0
    for step in SCHEDULE:
        mine = step[rank]
        toks = [rng.randrange(2, vocab) for _ in mine]
        got = ep.step(mine, toks).float()
        steps += 1
        if not mine:
            assert got.shape[0] == 0
            continue
        want = full([(states[i], [t]) for i, t in zip(mine, toks)]).float()
        scale = want.abs().max().item()
        worst = max(worst, (got - want).abs().max().item() / scale)
        if one is not None:
            ref = one.step(mine, toks).float()
            worst_one = max(worst_one, (got - ref).abs().max().item() / ref.abs().max().item())
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        else:
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(mine)
    experts_here = sharded.model.layers[0].mlp.experts.ep_count
    with open(out, "w") as f:
        json.dump(
            {"rank": rank, "worst_vs_general": worst, "worst_vs_one_gpu_static": worst_one, "agree": agree,
             "total": total, "steps": steps, "local_experts": experts_here,
             "experts": full.model.layers[0].mlp.experts.gate_up_proj.shape[0]}, f,
        )  # fmt: skip
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    if use_graphs and backend == "nccl":
        # NCCL communicators captured in live CUDA graphs hang destroy_process_group (seen on two
        # H200s: both ranks waited there with every result written); the results are on disk,
        # so the process leaves without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def spawn(tmp_path, model_dir, backend: str, dtype: str = "float32", use_graphs: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'ep_init'}"
    outs = [str(tmp_path / f"ep_rank{r}.json") for r in range(2)]
    mp.start_processes(_entry, args=(2, init, str(model_dir), backend, dtype, use_graphs, outs), nprocs=2, join=True, start_method="spawn")
    return [json.load(open(p)) for p in outs]


def _entry(rank, world, init, model_dir, backend, dtype, use_graphs, outs):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(rank, world, init, model_dir, backend, dtype, use_graphs, outs[rank])
