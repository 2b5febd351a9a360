"""Expert parallelism over 2 GPUs vs one GPU holding every expert: decode step of the 4-layer
V4-Flash-width slice (``gpu_slice_bench``'s model: hidden 4096, 64×512 heads, 256 experts top-6,
layers HCA/HCA/HCA/CSA, random bf16 weights, tid2eid with k distinct random experts).

``python -m bench.ep_bench --output ep.json`` starts one process per GPU (NCCL; gloo and a
narrow model with ``--small`` on CPU). Each rank builds the same model (same seed), prefills one
context and clones it into its slots, then measures, in this order:

1. one GPU (``StaticDecoder``, all 256 experts on each GPU, the GPUs independent): b and 2b;
2. the same with FP8 experts (``engine.model.fp8``), unless ``--no-fp8``;
3. EP (``EPDecoder``, 128 experts per GPU, data-parallel attention): b per rank (2b in total), bf16
   then FP8 experts; plus uneven steps (b on rank 0, 0 or 1 on rank 1).

"step ms" = ``step`` as an engine calls it (bucket agreement over gloo, input copy, graph
replay, sync); "replay ms" = back-to-back ``graph.replay()`` (CUDA events, ranks released together
by a barrier). EP logits are checked against the one-GPU static step of the same rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from bench.kernel_helpers import replay_ms


def build_model(device: str, small: bool, seed: int = 0):
    from transformers import DeepseekV4Config

    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM

    small_kw = dict(
        hidden_size=128, head_dim=64, num_attention_heads=4, q_lora_rank=64, o_lora_rank=32, o_groups=2,
        moe_intermediate_size=64, n_routed_experts=16, index_n_heads=4, index_head_dim=32, index_topk=16, vocab_size=1000,
    )  # fmt: skip
    hf_cfg = DeepseekV4Config(num_hidden_layers=4, **(small_kw if small else {}))
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, dtype).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()]):
            if name.endswith("tid2eid"):
                e = cfg.n_routed_experts
                for a in range(0, t.shape[0], 16384):
                    m = min(16384, t.shape[0] - a)
                    t[a : a + m] = torch.rand(m, e, generator=g, device=device).argsort(-1)[:, : t.shape[1]]
            elif name.endswith(("layernorm.weight", "norm.weight")):
                t.normal_(1.0, 0.1, generator=g)
            elif name.endswith(("sinks", "e_score_correction_bias", ".base", "hc_base", "position_bias")):
                t.normal_(0.0, 0.5, generator=g)
            elif name.endswith((".scale", "hc_scale")):
                t.normal_(1.0, 0.2, generator=g)
            elif name.endswith((".fn", "hc_fn")):
                t.normal_(0.0, 0.05, generator=g)
            elif name.endswith("embed_tokens.weight"):
                t.normal_(0.0, 1.0, generator=g)
            elif t.is_floating_point():
                t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=g)
    return model, cfg


def _sync(device) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(dec, n: int, base, toks, iters: int, device: str, barrier: bool = False) -> float:
    """Mean seconds of ``dec.step`` over ``n`` rows (slots reloaded with ``base`` first)."""
    for i in range(n):
        dec.load(i, base)
    slots = list(range(n))
    for _ in range(2):
        dec.step(slots, toks[:n])
    _sync(device)
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dec.step(slots, toks[:n])
    _sync(device)
    return (time.perf_counter() - t0) / iters


def timed_replay(dec, b: int, iters: int, barrier: bool) -> float:
    if not dec.use_graphs or b not in dec._graphs:
        return float("nan")
    graph, _ = dec._graphs[b]
    return replay_ms(graph, iters, dist.barrier if barrier else None) / 1e3


def first_logits(dec, n: int, base, toks) -> torch.Tensor:
    for i in range(n):
        dec.load(i, base)
    return dec.step(list(range(n)), toks[:n]).float().clone()


def rank_main(rank: int, world: int, init: str, args) -> None:
    from engine.model.fp8 import attach_fp8_experts
    from engine.model.static_decode import StaticDecoder, bucket_for
    from engine.parallel.ep import EPDecoder, cpu_group_for

    cuda = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if cuda else "gloo"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    cpu_group = cpu_group_for(None)
    log = (lambda *a: print(f"[rank {rank}]", *a, flush=True)) if rank == 0 or args.verbose else (lambda *a: None)
    t0 = time.perf_counter()
    model, cfg = build_model(device, args.small)
    log(f"model built in {time.perf_counter() - t0:.1f} s, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params")
    b = args.batch
    ctx = args.context
    gen = torch.Generator().manual_seed(1)  # same prompt on both ranks
    prompt = torch.randint(2, cfg.vocab_size, (ctx,), generator=gen).tolist()
    base = model.new_state()
    with torch.inference_mode():
        model([(base, prompt)])
    tgen = torch.Generator().manual_seed(10 + rank)  # each rank its own next tokens
    toks = torch.randint(2, cfg.vocab_size, (2 * b,), generator=tgen).tolist()
    max_tokens = ctx + 3 * (args.iters + 4) + 8
    rows: list[dict] = []
    refs: dict[str, torch.Tensor] = {}

    def one_gpu(tag: str) -> None:
        dec = StaticDecoder(model, max_slots=2 * b, max_tokens=max_tokens)
        refs[tag] = first_logits(dec, b, base, toks)
        for n in (b, 2 * b):
            t = timed_steps(dec, n, base, toks, args.iters, device)
            r = timed_replay(dec, bucket_for(n, dec.buckets), args.iters, False)
            rows.append({"what": f"one GPU {tag} b={n}", "step_ms": t * 1e3, "replay_ms": r * 1e3, "tokens_per_s_per_gpu": n / t})
            log(rows[-1])
        del dec
        if cuda:
            torch.cuda.empty_cache()

    one_gpu("bf16")
    fp8 = None
    if not args.no_fp8:
        attach_fp8_experts(model)
        one_gpu("fp8")
        fp8 = True
    # ---- expert parallel ----
    stash = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp.experts, "fp8"):
            stash[i] = layer.mlp.experts.fp8
            del layer.mlp.experts.fp8
    ep_fp8 = {}

    def ep_rows(tag: str) -> None:
        dec = EPDecoder(model, max_slots=2 * b, max_tokens=max_tokens, cpu_group=cpu_group)
        got = first_logits(dec, b, base, toks)
        want = refs[tag]
        rel = ((got - want).abs().max() / want.abs().max()).item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        t = timed_steps(dec, b, base, toks, args.iters, device, barrier=True)
        r = timed_replay(dec, bucket_for(b, dec.buckets), args.iters, True)
        rows.append({
            "what": f"EP x{world} {tag} b={b} per rank ({world * b} total)", "rank": rank, "step_ms": t * 1e3, "replay_ms": r * 1e3,
            "tokens_per_s_total": world * b / t, "rel_err_vs_one_gpu": rel, "argmax_agree_vs_one_gpu": agree,
        })  # fmt: skip
        log(rows[-1])
        for other in (0, 1):  # uneven: rank 0 has b rows, the others `other`
            n = b if rank == 0 else other
            tt = timed_steps(dec, n, base, toks, args.iters, device, barrier=True)
            rows.append({"what": f"EP x{world} {tag} uneven: rank0 b={b}, others {other}", "rank": rank, "step_ms": tt * 1e3,
                         "tokens_per_s_total": (b + (world - 1) * other) / tt})  # fmt: skip
            log(rows[-1])
        del dec
        if cuda:
            torch.cuda.empty_cache()

    ep_rows("bf16")  # shards the experts (bf16 and, stashed, nothing else yet)
    if fp8:
        lo = model.model.layers[0].mlp.experts.ep_first
        n_loc = model.model.layers[0].mlp.experts.ep_count
        for i, layer in enumerate(model.model.layers):
            layer.mlp.experts.fp8 = tuple(t[lo : lo + n_loc].clone() for t in stash[i])
        stash.clear()
        ep_rows("fp8")
    allrows = [None] * world
    dist.all_gather_object(allrows, rows)
    if rank == 0:
        out = {"world": world, "batch_per_rank": b, "context": ctx, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
               "rows": allrows}  # fmt: skip
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out["rows"][0], indent=1))
    dist.barrier()
    if cuda:  # communicators captured in live CUDA graphs hang destroy_process_group: leave
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def _entry(rank, world, init, args):
    try:
        rank_main(rank, world, init, args)
    except Exception:
        traceback.print_exc()
        raise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="ep.json")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    init = f"file://{tempfile.mkdtemp()}/init"
    mp.start_processes(_entry, args=(args.world, init, args), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
